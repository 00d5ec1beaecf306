"""`ember push`, `pull` and `ls` through `ember.cli.main.main`: exit codes, the lines they print,
and one-line errors (never a traceback)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from ember.cli.main import main
from ember.package import Lock, verify_package


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err
    return code, out, err


def one_error_line(err: str) -> str:
    lines = err.splitlines()
    assert len(lines) == 1, err
    return lines[0]


def test_push_pull_ls_with_the_default_registry(capsys, make_package, tmp_path, monkeypatch):
    registry = tmp_path / "default-registry"
    monkeypatch.setenv("EMBER_REGISTRY", str(registry))
    src = make_package()
    code, out, _ = run(capsys, "push", str(src))
    lock = Lock.from_json((src / "ember.lock").read_bytes())
    assert code == 0
    assert out.startswith(f"pushed tiny:0.1.0 (sha256:{lock.digest[7:19]}) to {registry}: 3 blobs uploaded (")
    assert out.rstrip().endswith("0 already in the registry")

    code, out, _ = run(capsys, "push", str(src))
    assert code == 0 and "already pushed" in out and "nothing to upload" in out

    code, out, _ = run(capsys, "pull", "tiny", "--to", str(tmp_path / "out"))
    assert code == 0 and out.startswith(f"pulled tiny:0.1.0 (sha256:{lock.digest[7:19]}) to {tmp_path / 'out'}")
    assert verify_package(tmp_path / "out") == lock

    code, out, _ = run(capsys, "ls")
    assert code == 0
    assert re.search(rf"tiny\s.*0\.1\.0\s.*sha256:{lock.digest[7:19]}\s", out), out


def test_changing_only_hooks_says_one_blob_was_uploaded(capsys, make_package, tmp_path):
    registry = str(tmp_path / "registry")
    src = make_package()
    (src / "hooks.py").write_text("A = 1\n")
    assert run(capsys, "push", str(src), "--registry", registry)[0] == 0
    (src / "hooks.py").write_text("A = 22\n")

    code, _, err = run(capsys, "push", str(src), "--registry", registry)
    assert code == 1
    assert one_error_line(err).startswith("ember push: error: tiny:0.1.0 is already in ")
    assert "bump [model] version in " in err and err.rstrip().endswith(", or --force")

    code, out, _ = run(capsys, "push", str(src), "--registry", registry, "--force")
    assert code == 0
    assert re.fullmatch(r"pushed tiny:0\.1\.0 \(sha256:[0-9a-f]{12}\) to .*: 1 blob uploaded \(7 B\), "
                        r"3 already in the registry\n", out), out


def test_push_pull_ls_on_s3(capsys, s3_endpoint, s3_bucket, make_package, tmp_path):
    url = f"s3://{s3_bucket}/ember"
    for version in ("0.1.0", "0.2.0"):
        code, out, _ = run(capsys, "push", str(make_package(version=version)), "--registry", url,
                           "--endpoint-url", s3_endpoint)
        assert code == 0 and f"to {url}:" in out

    code, out, _ = run(capsys, "pull", "tiny", "--registry", url, "--endpoint-url", s3_endpoint,
                       "--to", str(tmp_path / "out"))
    assert code == 0 and "pulled tiny:0.2.0" in out and "3 blobs downloaded" in out
    verify_package(tmp_path / "out")

    code, out, _ = run(capsys, "ls", "--registry", url, "--endpoint-url", s3_endpoint)
    assert code == 0 and url in out
    rows = [[cell for cell in line.split() if cell != "│"] for line in out.splitlines() if "sha256:" in line]
    assert [row[:2] for row in rows] == [["tiny", "0.1.0"], ["tiny", "0.2.0"]]


def test_ls_of_an_empty_registry(capsys, tmp_path):
    code, out, _ = run(capsys, "ls", "--registry", str(tmp_path / "nothing"))
    assert code == 0 and out == f"no packages in {tmp_path / 'nothing'}\n"


def test_endpoint_down_is_one_line(capsys, dead_endpoint, make_package, tmp_path):
    for argv in (["push", str(make_package())], ["pull", "tiny", "--to", str(tmp_path / "out")], ["ls"]):
        code, _, err = run(capsys, *argv, "--registry", "s3://bucket/prefix", "--endpoint-url", dead_endpoint)
        assert code == 1
        assert one_error_line(err) == (f"ember {argv[0]}: error: s3://bucket/prefix: cannot reach endpoint "
                                       f"{dead_endpoint} (connection refused)")
    assert not (tmp_path / "out").exists()


def test_pull_errors_are_one_line(capsys, make_package, tmp_path):
    registry = str(tmp_path / "registry")
    run(capsys, "push", str(make_package()), "--registry", registry)
    code, _, err = run(capsys, "pull", "tiny:2.0", "--registry", registry, "--to", str(tmp_path / "out"))
    assert code == 1
    assert one_error_line(err).endswith("tiny has no version '2.0' (available: 0.1.0)")

    code, _, err = run(capsys, "pull", "../tiny", "--registry", registry, "--to", str(tmp_path / "out"))
    assert code == 1 and "is not a package reference" in one_error_line(err)

    blob = next((Path(registry) / "blobs" / "sha256").iterdir())
    blob.unlink()
    blob.write_bytes(b"evil")
    code, _, err = run(capsys, "pull", "tiny", "--registry", registry, "--to", str(tmp_path / "out"))
    assert code == 1 and "refusing it" in one_error_line(err)
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".") or p.name == "out") == []
