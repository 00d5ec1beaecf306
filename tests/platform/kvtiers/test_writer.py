"""The async writer: hand-over never blocks; a full queue drops (and counts); flush and close wait for writes."""

from __future__ import annotations

import threading

from ember_platform.kvtiers.writer import AsyncWriter, WriteJob


def test_a_full_queue_drops_instead_of_blocking() -> None:
    gate = threading.Event()
    written: list[bytes] = []
    released: list[bytes] = []

    def write(job: WriteJob) -> None:
        gate.wait()
        written.append(job.block_hash)

    writer = AsyncWriter("test", write, max_pending=2)
    jobs = [WriteJob(bytes([i]) * 16, None, lambda i=i: released.append(bytes([i]) * 16)) for i in range(6)]
    accepted = [writer.submit(job) for job in jobs]  # one is taken by the thread, two wait, the rest drop
    assert accepted.count(False) >= 3 and writer.num_dropped == accepted.count(False)
    assert all(jobs[i].block_hash in released for i, ok in enumerate(accepted) if not ok)  # done() ran for drops
    gate.set()
    assert writer.flush(5)
    assert len(written) == accepted.count(True) == writer.num_written
    assert sorted(released) == sorted(j.block_hash for j in jobs)  # every job released exactly once
    writer.close()


def test_a_failing_write_is_counted_and_the_thread_goes_on() -> None:
    def write(job: WriteJob) -> None:
        if job.block_hash == b"bad":
            raise OSError("disk full")

    writer = AsyncWriter("test", write)
    writer.submit(WriteJob(b"bad", None))
    writer.submit(WriteJob(b"good", None))
    assert writer.flush(5)
    assert (writer.num_failed, writer.num_written) == (1, 1)
    writer.close()


def test_close_stops_the_thread_and_later_jobs_are_dropped() -> None:
    writer = AsyncWriter("test", lambda job: None)
    writer.close()
    assert not writer._thread.is_alive()
    assert writer.submit(WriteJob(b"late", None)) is False and writer.num_dropped == 1


def test_idle_hook_runs_periodically() -> None:
    ran = threading.Event()
    writer = AsyncWriter("test", lambda job: None, idle=ran.set, idle_s=0.05)
    assert ran.wait(5)
    writer.close()
