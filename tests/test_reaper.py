"""A test run that dies without teardown leaves no process behind (tests/fixtures/reaper.py)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REAPER = Path(__file__).resolve().parent / "fixtures" / "reaper.py"

# A stand-in for a pytest run: it starts a server-like child (which starts one of its own, in a new session, as
# `ember serve` starts replicas), starts the reaper on itself, prints the pids, and dies by SIGKILL: no teardown.
DOOMED_RUN = f"""
import os, signal, subprocess, sys, time
reaper = subprocess.Popen([sys.executable, {str(REAPER)!r}, str(os.getpid())], start_new_session=True)
server = subprocess.Popen([sys.executable, "-c",
    "import subprocess, sys, time; "
    "c = subprocess.Popen(['sleep', '300'], start_new_session=True); print(c.pid, flush=True); time.sleep(300)"],
    stdout=subprocess.PIPE, text=True)
replica = int(server.stdout.readline())
print(reaper.pid, server.pid, replica, flush=True)
time.sleep(2.5)  # the reaper notes descendants about once a second
os.kill(os.getpid(), signal.SIGKILL)
"""


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the reaper reads /proc")
def test_processes_of_a_run_killed_without_teardown_are_stopped() -> None:
    run = subprocess.run([sys.executable, "-c", DOOMED_RUN], capture_output=True, text=True, timeout=60)
    assert run.returncode == -signal.SIGKILL
    reaper, server, replica = map(int, run.stdout.split())
    try:
        deadline = time.monotonic() + 15
        while (_alive(server) or _alive(replica)) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(server) and not _alive(replica)
        while _alive(reaper) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(reaper), "the reaper itself must exit once it has stopped everything"
    finally:
        for pid in (server, replica):
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
