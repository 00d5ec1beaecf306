"""`ember quantize DIR --method M [--calibration FILE]` end to end on a copy of the example package: the quantized
weights and a quality report land in the package, locked and verified like the weights; serving the package then
loads them without calibrating or quantizing, and computes what a fresh quantization on the same text computes.
A replica process serving it reports no quantize phase. Errors name the flag or file and key."""

from __future__ import annotations

import inspect
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import tomllib
from collections.abc import Callable
from pathlib import Path

import httpx
import openai
import pytest
import torch

from ember.cli.main import main
from ember.package.lock import LOCK_NAME, Lock
from ember_platform import LLM, SamplingParams
from ember_platform.engine.calibration import run_prefill
from ember_platform.quantize_package import split_held_out
from ember_plugins.quantization.gptq_calibrated import GPTQStoredMethod
from ember_plugins.quantization.int4 import Int4Method
from ember_plugins.quantization.int8 import Int8LinearMethod

GPTQ_TABLE = '\n[quantization]\nmethod = "gptq"\noptions = { num_samples = 6, seq_len = 128, group_size = 64 }\n'
IDS = list(range(300, 340))


def calibration_file(tmp_path: Path) -> Path:
    path = tmp_path / "calibration.txt"
    path.write_text(inspect.getsource(json.decoder) + inspect.getsource(logging), encoding="utf-8")
    return path


def quantize(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, dict, str]:
    capsys.readouterr()
    rc = main(["quantize", *args, "--json"])
    out, err = capsys.readouterr()
    return rc, (json.loads(out.strip().splitlines()[-1]) if rc == 0 else {}), err


def logits(llm: LLM) -> torch.Tensor:
    with torch.inference_mode():
        return llm.engine.model.compute_logits(run_prefill(llm.engine.model, IDS))


def serve_once(package: Path, tmp_path: Path, prompt: list[int]) -> tuple[dict, str]:
    """Start a replica process for `package` (no quantized-weight cache, no calibration file it could read), ask it
    /info and one greedy completion of 16 tokens, stop it."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "EMBER_QUANTIZED_CACHE": "off",
           "EMBER_CALIBRATION_FILE": str(tmp_path / "absent.txt")}
    with (tmp_path / "replica.log").open("w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "ember_platform.replica", "--package", str(package), "--port",
                                 "0", "--threads", "1", "--log-level", "warning", "--no-auth"],
                                stdout=subprocess.PIPE, stderr=log, text=True, env=env)
    try:
        assert proc.stdout is not None
        for line in proc.stdout:  # ends when the process does
            if line.startswith("EMBER_REPLICA_READY "):
                url = line.split(" ", 1)[1].strip()
                break
        else:
            pytest.fail(f"the replica exited before it was ready:\n{(tmp_path / 'replica.log').read_text()[-3000:]}")
        info = httpx.get(f"{url}/info", timeout=30).json()
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=120)
        out = client.completions.create(model=info["name"], prompt=prompt, max_tokens=16, temperature=0,
                                        extra_body={"ignore_eos": True})
        return info, out.choices[0].text
    finally:
        proc.kill()
        proc.wait(timeout=15)


def test_quantize_ships_gptq_weights_that_replicas_load_without_quantizing(
        tmp_path: Path, example_copy: Callable[..., Path], capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    package = example_copy(tmp_path / "pkg", manifest_extra=GPTQ_TABLE)
    calibration = calibration_file(tmp_path)
    rc, report, err = quantize(capsys, str(package), "--method", "gptq", "--calibration", str(calibration))
    assert rc == 0, err
    assert report["method"] == "gptq" and report["layers"] == 16
    held = report["held_out"]
    assert held["tokens"] > 100 and 1 < held["perplexity_before"] < held["perplexity_after"] * 1.05
    assert 0 <= report["greedy_agreement"]["agreement"] <= 1 and report["greedy_agreement"]["tokens"] == 64
    entry = json.loads((package / "quantized" / "gptq" / "quantization.json").read_text())
    assert entry["options"] == {"num_samples": 6, "seq_len": 128, "group_size": 64} and entry["report"]["held_out"]

    # Content-addressed like every other file: locked, verified, and a changed byte is caught.
    locked = {f.path for f in Lock.from_json((package / LOCK_NAME).read_bytes()).files}
    assert {"quantized/gptq/model.safetensors", "quantized/gptq/quantization.json"} <= locked
    assert main(["verify", str(package)]) == 0

    # Serving: no cache to fall back on, and a calibration file that does not exist, so calibrating would fail.
    monkeypatch.setenv("EMBER_QUANTIZED_CACHE", "off")
    monkeypatch.setenv("EMBER_CALIBRATION_FILE", str(tmp_path / "absent.txt"))
    served = LLM(package)
    assert served.engine.quantized_from_cache and served.engine.timings["quantize"] == 0.0
    down = served.engine.model.model.layers[2].mlp.down_proj
    assert isinstance(down.method, GPTQStoredMethod) and isinstance(down.method.storage, Int4Method)
    assert down.int4_packed.dtype == torch.uint8 and "gptq 4-bit sym, group 64, act-order: int4" in down.extra_repr()

    # ... and it computes what quantizing afresh on the same calibration text computes.
    fresh_package = tmp_path / "fresh"
    shutil.copytree(package, fresh_package, ignore=shutil.ignore_patterns("quantized"))
    calibrated_part = tmp_path / "part.txt"
    calibrated_part.write_text(split_held_out(calibration.read_text())[0], encoding="utf-8")
    monkeypatch.setenv("EMBER_CALIBRATION_FILE", str(calibrated_part))
    fresh = LLM(fresh_package)
    assert not fresh.engine.quantized_from_cache and fresh.engine.timings["quantize"] > 0
    torch.testing.assert_close(logits(served), logits(fresh), rtol=0, atol=1e-5)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    assert served.generate([IDS[:8]], params)[0].token_ids == fresh.generate([IDS[:8]], params)[0].token_ids

    # A replica process serving the package: its cold start shows no quantize phase, and it answers as the engine.
    replica_info, text = serve_once(package, tmp_path, IDS[:8])
    assert replica_info["timings"]["quantize"] == 0.0 and replica_info["selections"]["quantization"]["name"] == "gptq"
    assert text == served.tokenizer.decode(served.generate([IDS[:8]], params)[0].token_ids)

    weights = package / "quantized" / "gptq" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1
    weights.write_bytes(bytes(data))
    assert main(["verify", str(package)]) == 1
    assert "quantized/gptq/model.safetensors: sha256" in capsys.readouterr().err


def test_quantize_with_any_method_adds_it_to_a_manifest_without_one(
        tmp_path: Path, example_copy: Callable[..., Path], capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    package = example_copy(tmp_path / "pkg")
    rc, report, err = quantize(capsys, str(package), "--method", "int8")
    assert rc == 0, err
    assert report["held_out"]["perplexity_after"] is not None  # the platform's corpus, less its held-out tenth
    manifest = tomllib.loads((package / "ember.toml").read_text())
    assert manifest["quantization"] == {"method": "int8"}
    assert main(["verify", str(package)]) == 0
    monkeypatch.setenv("EMBER_QUANTIZED_CACHE", "off")
    served = LLM(package)
    assert served.engine.quantized_from_cache and served.engine.timings["quantize"] == 0.0
    assert isinstance(served.engine.model.model.layers[0].self_attn.qkv_proj.method, Int8LinearMethod)
    # Other options than the entry was made with: the entry is not used, the engine quantizes.
    other = LLM(package, quantization_options={"kernel": "int8pack"})
    assert not other.engine.quantized_from_cache


@pytest.mark.parametrize(("method", "table", "technique"), [
    (["rotation", "int4"], "{ rotation = { seed = 3, candidates = 2 }, int4 = { group_size = 64 } }", "rotation"),
    ("mixed", "{ average_bits = 5.0, group_size = 64, calibration_tokens = 2048 }", "mixed"),
])
def test_quantize_ships_what_the_techniques_chose_so_replicas_never_calibrate(
        tmp_path: Path, example_copy: Callable[..., Path], capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch, method: str | list[str], table: str, technique: str) -> None:
    """A rotation's seed chosen among candidates and mixed's plan go into the entry's quantization.json; a replica
    restores them with the int4 / int8 layers, calibrating nothing (the calibration file is absent and calibrate
    fails if called), and computes what quantizing afresh on the same text computes."""
    from ember_plugins.quantization.mixed import MixedQuantizer
    from ember_plugins.quantization.rotation import RotationQuantizer

    extra = f"\n[quantization]\nmethod = {json.dumps(method)}\noptions = {table}\n"
    package = example_copy(tmp_path / "pkg", manifest_extra=extra)
    calibration = calibration_file(tmp_path)
    selection = "+".join(method) if isinstance(method, list) else method
    rc, _, err = quantize(capsys, str(package), "--method", selection, "--calibration", str(calibration))
    assert rc == 0, err
    entry = json.loads((package / "quantized" / selection / "quantization.json").read_text())
    state = entry["techniques"][technique]
    assert ("seed" in state and state["seed"] in (3, 4)) if technique == "rotation" else state["layers"]

    monkeypatch.setenv("EMBER_QUANTIZED_CACHE", "off")
    monkeypatch.setenv("EMBER_CALIBRATION_FILE", str(tmp_path / "absent.txt"))
    calibrating = {"rotation": RotationQuantizer, "mixed": MixedQuantizer}[technique].calibrate

    def never(*_args: object) -> None:
        raise AssertionError("calibrated while serving shipped quantized weights")

    monkeypatch.setattr({"rotation": RotationQuantizer, "mixed": MixedQuantizer}[technique], "calibrate", never)
    served = LLM(package)
    assert served.engine.quantized_from_cache and served.engine.timings["quantize"] == 0.0
    assert served.engine.quantization_states[technique] == state
    same = ("seed",) if technique == "rotation" else ("layers", "plan")
    down = served.engine.model.model.layers[1].mlp.down_proj
    if technique == "rotation":
        assert down.method.rotation.seed == state["seed"] and isinstance(down.method.inner, Int4Method)

    monkeypatch.setattr({"rotation": RotationQuantizer, "mixed": MixedQuantizer}[technique], "calibrate", calibrating)
    fresh_package = tmp_path / "fresh"
    shutil.copytree(package, fresh_package, ignore=shutil.ignore_patterns("quantized"))
    part = tmp_path / "part.txt"
    part.write_text(split_held_out(calibration.read_text())[0], encoding="utf-8")
    monkeypatch.setenv("EMBER_CALIBRATION_FILE", str(part))
    fresh = LLM(fresh_package)
    assert not fresh.engine.quantized_from_cache
    assert {k: fresh.engine.quantization_states[technique][k] for k in same} == {k: state[k] for k in same}
    torch.testing.assert_close(logits(served), logits(fresh), rtol=0, atol=1e-5)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    assert served.generate([IDS[:8]], params)[0].token_ids == fresh.generate([IDS[:8]], params)[0].token_ids


BAD_BITS = '\n[quantization]\nmethod = "gptq"\noptions = { bits = 3 }\n'


@pytest.mark.parametrize(("table", "args", "message"), [
    ("", ["--method", "nope"], r"--method 'nope': no installed plugin provides quantization 'nope' \(installed: "),
    ("", ["--method", "[1]"], r"--method '\[1\]': a JSON list of method names"),
    ("", ["--method", "int8", "--calibration", "MISSING"], r"--calibration .*missing.txt: no such file"),
    ("", ["--method", "int8", "--calibration", "EMPTY"], r"--calibration .*empty.txt: the file is empty"),
    ("", ["--method", "int8", "--calibration", "BINARY"], r"--calibration .*binary.txt: not UTF-8 text"),
    (GPTQ_TABLE, ["--method", "int8"], r"ember.toml: \[quantization\] method = 'gptq', not --method 'int8'"),
    (BAD_BITS, ["--method", "gptq"], r"ember.toml: quantization.options.bits = 3: gptq stores 4-bit or 8-bit weights"),
])
def test_errors_name_the_flag_or_file_and_key(tmp_path: Path, example_copy: Callable[..., Path],
                                              capsys: pytest.CaptureFixture[str], table: str, args: list[str],
                                              message: str) -> None:
    package = example_copy(tmp_path / "pkg", manifest_extra=table)
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "binary.txt").write_bytes(b"\xff\xfe\x00code")
    files = {"MISSING": tmp_path / "missing.txt", "EMPTY": tmp_path / "empty.txt", "BINARY": tmp_path / "binary.txt"}
    rc, _, err = quantize(capsys, str(package), *[str(files.get(a, a)) for a in args])
    assert rc == 1
    assert "ember quantize: error: " in err and re.search(message, err), err
    assert not (package / "quantized").exists()
