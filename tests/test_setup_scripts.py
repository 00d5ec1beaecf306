"""The README's two commands install what each needs: the demo (`scripts/demo`) serves with in-process routing
tables and never installs redis-server; the tests (`scripts/test`, which .ci/run calls) do, since they run it."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SCRIPTS = REPO / "scripts"


def system_packages(*args: str) -> list[str]:
    done = subprocess.run(["bash", str(SCRIPTS / "setup-env"), *args, "--print-system-packages"],
                          capture_output=True, text=True, timeout=30, check=True)
    return done.stdout.split()


def setup_arguments(script: str) -> list[list[str]]:
    calls = re.findall(r"^\s*bash scripts/setup-env(.*)$", (SCRIPTS / script).read_text(), re.MULTILINE)
    return [call.split() for call in calls]


def test_the_demo_installs_no_redis_server_and_the_tests_do() -> None:
    [demo] = setup_arguments("demo")
    [tests] = setup_arguments("test")
    assert "redis-server" not in system_packages(*demo)
    assert "redis-server" in system_packages(*tests)
    assert "ember serve" in (SCRIPTS / "demo").read_text() and "--redis-url" not in (SCRIPTS / "demo").read_text()


def test_ci_runs_exactly_the_readme_test_command() -> None:
    assert "bash scripts/test" in (REPO / "README.md").read_text()
    assert re.search(r"^\s*(exec )?bash scripts/test\s*$", (REPO / ".ci" / "run").read_text(), re.MULTILINE)


def test_an_unknown_setup_argument_is_refused() -> None:
    done = subprocess.run(["bash", str(SCRIPTS / "setup-env"), "--bogus"], capture_output=True, text=True, timeout=30)
    assert done.returncode == 2 and "unknown argument --bogus" in done.stderr
