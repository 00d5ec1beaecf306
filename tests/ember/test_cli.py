"""The `ember` command line: every command explains itself; user mistakes never print a traceback."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ember.cli.main import COMMAND_MODULES, build_parser

COMMANDS = ["init", "build", "verify", "push", "pull", "ls", "schema", "plugins", "explain"]


def ember(*args: str, env: dict[str, str] | None = None, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ember", *args], capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, cwd=cwd, timeout=120)


def test_every_command_is_registered() -> None:
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    assert set(COMMANDS) <= set(sub.choices), COMMAND_MODULES


def test_top_level_help_lists_commands() -> None:
    out = ember("--help")
    assert out.returncode == 0
    for command in COMMANDS:
        assert command in out.stdout


@pytest.mark.parametrize("command", COMMANDS)
def test_each_command_explains_itself(command: str) -> None:
    out = ember(command, "--help")
    assert out.returncode == 0, out.stderr
    assert f"usage: ember {command}" in out.stdout
    description = out.stdout.split("\n\n")[1]
    assert len(description.split()) >= 5, f"`ember {command} --help` has no real description"


def test_schema_is_json_schema_of_the_manifest() -> None:
    out = ember("schema")
    schema = json.loads(out.stdout)
    assert schema["title"] == "ember.toml"
    assert {"model", "runtime", "quantization", "speculator", "parallelism", "kernels", "scaling", "lora",
            "serving"} <= set(schema["properties"])


def test_explain_reports_choices_and_reasons(make_package) -> None:
    pkg = make_package(extra_toml='[quantization]\nmethod = "none"\n')
    out = ember("explain", str(pkg), "--json")
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert doc["package"] == "tiny:0.1.0"
    assert doc["selections"]["quantization"] == {
        "kind": "quantization", "name": "none", "options": {}, "decided_by": "manifest",
        "reason": "quantization.method = 'none' in ember.toml"}
    assert doc["selections"]["parallelism"]["decided_by"] == "ember's auto fallback"


def test_plugins_lists_built_ins() -> None:
    out = ember("plugins", "--json")
    names = {p["name"]: p for p in json.loads(out.stdout)}
    assert names["auto"]["distribution"] == "ember"


def user_mistakes(pkg: Path, tmp_path: Path) -> list[tuple[list[str], str]]:
    bad_toml = tmp_path / "bad"
    bad_toml.mkdir()
    (bad_toml / "ember.toml").write_text('[model]\nname = "x"\nversion = "1"\n[runtime]\nmax_num_seq = 2\n')
    return [
        (["build", str(tmp_path / "missing")], "not a directory"),
        (["explain", str(bad_toml)], "did you mean 'max_num_seqs'"),
        (["build", str(bad_toml)], "did you mean 'max_num_seqs'"),
        (["verify", str(pkg)], "no ember.lock"),
        (["init", str(tmp_path / "new"), "--from", str(tmp_path / "nothing")], "Hugging Face checkpoint"),
        (["pull", "nope:1.0", "--to", str(tmp_path / "out")], "nope"),
        (["push", str(pkg), "--registry", "s3://bucket/prefix", "--endpoint-url", "http://127.0.0.1:9"],
         "127.0.0.1:9"),
    ]


def test_user_mistakes_print_one_line_without_traceback(make_package, tmp_path: Path) -> None:
    pkg = make_package()
    env = {"EMBER_REGISTRY": str(tmp_path / "registry"), "EMBER_CACHE": str(tmp_path / "cache"),
           "AWS_ACCESS_KEY_ID": "x", "AWS_SECRET_ACCESS_KEY": "x", "AWS_DEFAULT_REGION": "us-east-1"}
    for args, expected in user_mistakes(pkg, tmp_path):
        out = ember(*args, env=env)
        assert out.returncode != 0, args
        assert "Traceback" not in out.stderr, (args, out.stderr)
        assert expected in out.stderr, (args, out.stderr)
        assert out.stderr.startswith(f"ember {args[0]}: error: "), (args, out.stderr)


@pytest.mark.parametrize(("quantization", "expected"), [
    ('method = "int4"\noptions = { group_size = 48 }',
     "quantization.options.group_size = 48: int4 takes one of 32, 64, 128"),
    ('method = "gptq"\noptions = { bits = 3 }', "quantization.options.bits = 3: gptq stores 4-bit or 8-bit weights"),
    ('method = "mixed"\noptions = { average_bits = 4.0 }', "quantization.options.average_bits = 4.0: below 4.3125"),
    ('method = ["rotation", "int4"]\noptions = { rotation = { seed = -1 } }',
     "quantization.options.rotation.seed = -1: a non-negative integer"),
    ('method = ["rotation", "int4"]\noptions = { rotation = { kv_rotation = true } }',
     "quantization.options.rotation.kv_rotation = True: not supported yet"),
    ('method = "int8"\noptions = { skip = "lm_head" }', "quantization.options.skip = 'lm_head': a list of layer names"),
])
def test_explain_refuses_a_bad_quantization_option_value(make_package, quantization: str, expected: str) -> None:
    """The value checks the quantizers run when an engine builds them (ember_plugins/quantization/options.py),
    run by `ember explain` too, without torch: the same message, naming the key."""
    pkg = make_package(extra_toml=f"[quantization]\n{quantization}\n")
    out = ember("explain", str(pkg))
    assert out.returncode != 0, out.stdout
    assert "Traceback" not in out.stderr, out.stderr
    assert out.stderr.startswith("ember explain: error: "), out.stderr
    assert expected in out.stderr, out.stderr
    good = make_package(extra_toml='[quantization]\nmethod = ["rotation", "int4"]\noptions = '
                                   '{ rotation = { seed = 3, candidates = 4 }, int4 = { group_size = 64 } }\n')
    assert ember("explain", str(good)).returncode == 0
