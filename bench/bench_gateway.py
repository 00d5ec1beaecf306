"""Serving overhead: the same workload through the gateway (`ember serve`, OpenAI HTTP, streamed) vs the
in-process engine, and straight to the gateway's replica, to split the added latency.

    python bench/bench_gateway.py [--model examples/tiny-llama] [--quick] [--repeats 3] [--requests 32] [--threads 1]
                                  [--client openai|raw]

Three paths, the same workload, every request submitted at once on each:
  in-process  `LLM(model)`'s engine under `AsyncEngine` (the step loop the replica runs), in this process;
  gateway     `ember serve MODEL --no-auth --port 0` in a subprocess, pinned to one replica process (the
              autoscaler would start a second at 32 requests in flight), called with `openai.AsyncOpenAI` on
              /v1/completions: token-id prompts, greedy, EOS ignored, streamed;
  replica     the same requests sent straight to that replica's URL (from GET /models/NAME/info).
Both sides do the same work per token: token-id prompts (no tokenizing), and the engine detokenizes in its step
on both; the HTTP paths add the SSE encoding and the client's parsing. The replica, at its default stream event
rate, sends each stream's tokens of several steps per SSE chunk when many streams are open ("tokens per text
event" is printed); the in-process side reads every step's output.
The workload (fixed seed): --requests prompts, lengths uniform in 16..256, outputs uniform in 32..128 tokens.
Each run sends fresh windows of standard-library code with the same lengths (prefix caching is on in both
engines, so a prompt seen before would skip its prefill). Output tokens/s = output tokens / wall time, from
the first submit to the last token; TTFT and end-to-end latency are timed per request from that same start,
TTFT at the first non-empty text (what a streaming client sees). Added latency is paired by request (same
lengths): gateway - in-process in each repeat, then the median over repeats; gateway - replica is the
gateway hop alone, replica - in-process the replica's HTTP/SSE layer plus the client. The client runs on the
same cores as the server, so its own parsing slows the HTTP paths too: CPU seconds per process are printed,
and `--client raw` (httpx, json.loads per SSE line) shows how much of the loss is the openai client's.
Where the engine's time goes (Linux): its step thread's seconds on a CPU, runnable but waiting for a core, and
neither (waiting for the GIL, or for work), from /proc/PID/task/*/schedstat, in this process for in-process and
in the replica otherwise. On a CPU is about the same on every path (the same steps); what the HTTP paths add
to the wall time is the other two: waiting for a core while the client, the gateway and the replica's event
loop (and anything else on the machine) run, and "neither", mostly the start: the openai client builds all
its requests before the first goes out (~6 ms each here), and the engine is idle until one arrives.

Threads: this process uses `torch.set_num_threads(--threads)`; `ember serve` has no threads flag, so the
replica gets OMP_NUM_THREADS=--threads (torch's default thread count; the launcher then passes no --threads of
its own) and this process's OMP_WAIT_POLICY.
The default is 1, not 2 as in the other benchmarks: the HTTP paths run three processes (client, gateway,
replica) on what may be a 2-core machine, and two torch threads in the replica would oversubscribe it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import os
import queue
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from common import EXAMPLE_MODEL, emit, environment, median, parse_args, print_table, random_code_tokens, spread

from ember_plugins.launchers.local import die_with_parent

TARGET = 0.9  # gateway tokens/s over in-process tokens/s: at most 10% lost
SEED = 1234
PROMPT_LEN = (16, 256)
OUTPUT_LEN = (32, 128)
WARMUP_TOKENS = 16
READY_LINE = "EMBER_SERVE_READY"
REPLICA_SECRET = "bench-replica-secret"  # $EMBER_REPLICA_SECRET for the gateway's replicas (replica/auth.py)
START_TIMEOUT_S = 240.0  # ember serve: push, pull, replica start
STOP_TIMEOUT_S = 45.0  # SIGTERM drains the replicas (their drain timeout is 30 s); then SIGKILL
RUN_TIMEOUT_S = 900.0  # one batch on one path
PATHS = ("in-process", "gateway", "replica")
KEEPALIVE_S = 5.0  # uvicorn's timeout_keep_alive and httpx's keepalive_expiry (both defaults)
KEEPALIVE_MARGIN_S = 1.0


def add_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--requests", type=int, default=None, help="requests per run (default 32; --quick: 8)")
    parser.add_argument("--client", choices=("openai", "raw"), default="openai",
                        help="HTTP client: openai.AsyncOpenAI (default), or raw httpx + json.loads per SSE line, "
                             "which spends less of the shared CPU on the client side")
    parser.set_defaults(threads=1)  # see the module docstring


# --- the server --------------------------------------------------------------------------------


class Server:
    """`ember serve MODEL` in a subprocess with its own EMBER_HOME, registry and cache under `workdir`."""

    def __init__(self, model: Path, threads: int, workdir: Path) -> None:
        self.model = model
        self.workdir = workdir
        self.threads = threads
        self.log_path = workdir / "serve.log"
        self.proc: subprocess.Popen[str] | None = None
        self.url = ""
        self.replica_pids: set[int] = set()
        self._lines: queue.Queue[str | None] = queue.Queue()

    def command(self) -> list[str]:
        ember = Path(sys.executable).with_name("ember")
        head = [str(ember)] if ember.exists() else [sys.executable, "-m", "ember.cli.main"]
        return [*head, "serve", str(self.model), "--no-auth", "--host", "127.0.0.1", "--port", "0",
                "--log-level", "warning"]

    def env(self) -> dict[str, str]:
        return {**os.environ, "EMBER_HOME": str(self.workdir / "home"),
                "EMBER_REGISTRY": str(self.workdir / "registry"), "EMBER_CACHE": str(self.workdir / "cache"),
                "OMP_NUM_THREADS": str(self.threads), "MKL_NUM_THREADS": str(self.threads), "PYTHONUNBUFFERED": "1",
                "EMBER_REPLICA_SECRET": REPLICA_SECRET}  # the bench calls the replica directly too

    def launch(self) -> None:
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(self.command(), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=log,
                                         text=True, env=self.env(), cwd=self.workdir, start_new_session=True,
                                         preexec_fn=die_with_parent())
        threading.Thread(target=self._read_stdout, name="serve-stdout", daemon=True).start()

    def _read_stdout(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        for line in self.proc.stdout:  # ends when the server exits; keeps the pipe from filling up
            self._lines.put(line)
        self._lines.put(None)

    def wait_ready(self, timeout: float = START_TIMEOUT_S) -> str:
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            try:
                line = self._lines.get(timeout=min(left, 1.0))
            except queue.Empty:
                continue
            if line is None:
                raise RuntimeError(f"ember serve exited with code {self.proc and self.proc.wait()} before it was ready"
                                   f"{self.tail()}")
            if line.startswith(READY_LINE):
                self.url = line.split()[1].rstrip("/")
                return self.url
        raise RuntimeError(f"ember serve was not ready within {timeout:.0f} s{self.tail()}")

    def tail(self, lines: int = 20) -> str:
        try:
            text = self.log_path.read_text(errors="replace").splitlines()[-lines:]
        except OSError:
            return ""
        return "; last lines of its log:\n" + "\n".join(f"  {line}" for line in text) if text else ""

    def stop(self) -> None:
        """SIGTERM (the server drains its replicas), wait, SIGKILL after STOP_TIMEOUT_S; then any replica left."""
        proc = self.proc
        if proc is not None and proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                print(f"ember serve (pid {proc.pid}) did not exit {STOP_TIMEOUT_S:.0f} s after SIGTERM: killing it",
                      file=sys.stderr)
                proc.kill()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(10)
        for pid in self.replica_pids:  # normally gone already: ember serve stops them, and they die with it
            _stop_pid(pid)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie is as good as gone
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except OSError:
        return True


def _stop_pid(pid: int, timeout: float = 10.0) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        if not _alive(pid):
            return
        print(f"replica pid {pid} still running: sending {sig.name}", file=sys.stderr)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)
        for _ in range(int(timeout / 0.1)):
            if not _alive(pid):
                return
            time.sleep(0.1)


def _exit_on_sigterm(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)  # unwinds through the `finally` that stops the server


# --- the workload and one run ------------------------------------------------------------------


@dataclass(slots=True)
class Workload:
    prompt_lens: list[int]
    output_lens: list[int]

    @classmethod
    def make(cls, num_requests: int, seed: int = SEED) -> Workload:
        rng = random.Random(seed)
        return cls([rng.randint(*PROMPT_LEN) for _ in range(num_requests)],
                   [rng.randint(*OUTPUT_LEN) for _ in range(num_requests)])

    def prompts(self, tokenizer: Any, seed: int) -> list[list[int]]:
        """Fresh code windows with these lengths: a new seed gives prompts no engine has cached."""
        rng = random.Random(seed)
        return [random_code_tokens(tokenizer, n, rng) for n in self.prompt_lens]


@dataclass(slots=True)
class Timing:
    """One request, timed from the batch's start: first non-empty text, last token, tokens made."""

    ttft: float = math.nan
    e2e: float = math.nan
    tokens: int = 0
    text: str = ""
    events: int = 0  # outputs with text: engine outputs in-process, SSE chunks over HTTP


@dataclass(slots=True)
class Run:
    wall: float
    timings: list[Timing]
    load: float  # 1-minute load average right after the run
    first_end: float  # perf_counter when its first request / last request finished
    last_end: float
    cpu: dict[str, float] = field(default_factory=dict)  # CPU seconds each process used during the run
    engine: dict[str, float] = field(default_factory=dict)  # the engine's step thread: see engine_thread()

    @property
    def tok_s(self) -> float:
        return sum(t.tokens for t in self.timings) / self.wall


Submit = Callable[[list[int], int, float], Awaitable[Timing]]


def cpu_seconds(pids: dict[str, int]) -> dict[str, float]:
    """User + system CPU seconds so far: this process (all its threads) and the named processes."""
    times = os.times()
    out = {"this": times.user + times.system}
    tick = os.sysconf("SC_CLK_TCK")
    for name, pid in pids.items():
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            out[name] = (int(fields[11]) + int(fields[12])) / tick  # utime, stime
        except (OSError, IndexError, ValueError):
            out[name] = math.nan
    return out


def thread_times(pid: int) -> dict[int, tuple[float, float]]:
    """Per thread of process `pid`: (seconds on a CPU, seconds runnable but waiting for one), from Linux's /proc
    (schedstat; CPU from stat's ticks, and NaN waiting, where the kernel keeps no schedstats). Empty elsewhere."""
    out: dict[int, tuple[float, float]] = {}
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
    except OSError:
        return out
    tick = os.sysconf("SC_CLK_TCK")
    for task in tasks:
        try:
            on_cpu, waiting = (int(x) / 1e9 for x in (task / "schedstat").read_text().split()[:2])
        except (OSError, ValueError):
            try:
                fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
                on_cpu, waiting = (int(fields[11]) + int(fields[12])) / tick, math.nan
            except (OSError, IndexError, ValueError):
                continue
        out[int(task.name)] = (on_cpu, waiting)
    return out


def engine_thread(before: dict[int, tuple[float, float]], after: dict[int, tuple[float, float]],
                  wall: float) -> dict[str, float]:
    """The engine's step thread during a run (the process's busiest thread): seconds on a CPU ("cpu"), runnable but
    waiting for a core ("runq": other processes had both), and neither ("off": waiting for the GIL, or for work,
    as before the first request arrives). In-process, cpu is about the whole wall time; over HTTP, what is not cpu
    is what the serving path costs the engine."""
    deltas = [(cpu - before.get(tid, (0.0, 0.0))[0], runq - before.get(tid, (0.0, 0.0))[1])
              for tid, (cpu, runq) in after.items()]
    if not deltas:
        return {}
    cpu, runq = max(deltas)
    return {"cpu": cpu, "runq": runq, "off": wall - cpu - (0.0 if math.isnan(runq) else runq)}


async def run_batch(submit: Submit, prompts: Sequence[list[int]], output_lens: Sequence[int],
                    pids: dict[str, int] | None = None, engine_pid: int | None = None) -> Run:
    """One batch, all requests at once; `engine_pid`: the process whose step thread to account (engine_thread)."""
    cpu0 = cpu_seconds(pids or {})
    threads0 = thread_times(engine_pid) if engine_pid else {}
    t0 = time.perf_counter()
    timings = await asyncio.wait_for(
        asyncio.gather(*(submit(p, n, t0) for p, n in zip(prompts, output_lens, strict=True))), RUN_TIMEOUT_S)
    wall = time.perf_counter() - t0
    for timing, n in zip(timings, output_lens, strict=True):
        if timing.tokens != n:
            raise RuntimeError(f"a request made {timing.tokens} tokens, not the {n} it asked for")
    cpu1 = cpu_seconds(pids or {})
    engine = engine_thread(threads0, thread_times(engine_pid), wall) if engine_pid else {}
    return Run(wall, list(timings), os.getloadavg()[0], t0 + min(t.e2e for t in timings),
               t0 + max(t.e2e for t in timings), {k: cpu1[k] - cpu0[k] for k in cpu0}, engine)


async def settle_keepalive(previous: Run | None) -> float:
    """Sleep so that no pooled HTTP connection of a path is reused right as its server closes it.

    uvicorn closes a connection idle for KEEPALIVE_S and httpx keeps one for KEEPALIVE_S too, so a request
    sent on a connection idle for about that long can meet a connection the server is closing: the client
    sees a ReadError (openai: "Connection error."), and the gateway, whose pool to the replica races the same
    way, answers 503 when its only replica is "unreachable". A path's connections went idle when its last
    run's requests finished: when some may be close to KEEPALIVE_S idle, wait until all are well past it (both
    ends have dropped them, and the run opens fresh connections). Returns the seconds slept.
    """
    if previous is None:
        return 0.0
    now = time.perf_counter()
    if now - previous.first_end < KEEPALIVE_S - KEEPALIVE_MARGIN_S:
        return 0.0
    pause = max(0.0, previous.last_end + KEEPALIVE_S + KEEPALIVE_MARGIN_S - now)
    await asyncio.sleep(pause)
    return pause


def inprocess_submit(aengine: Any) -> Submit:
    from ember_platform import SamplingParams

    async def submit(prompt: list[int], max_tokens: int, t0: float) -> Timing:
        timing = Timing()
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        async for out in aengine.generate(prompt, params):
            if out.new_text:
                if math.isnan(timing.ttft):
                    timing.ttft = time.perf_counter() - t0
                timing.events += 1
            timing.tokens += len(out.new_token_ids)
            timing.text += out.new_text
        timing.e2e = time.perf_counter() - t0
        return timing

    return submit


def openai_submit(client: Any, model: str) -> Submit:
    async def submit(prompt: list[int], max_tokens: int, t0: float) -> Timing:
        timing = Timing()
        stream = await client.completions.create(
            model=model, prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        async for chunk in stream:
            if chunk.choices and (text := chunk.choices[0].text):
                if math.isnan(timing.ttft):
                    timing.ttft = time.perf_counter() - t0
                timing.text += text
                timing.events += 1
            if chunk.usage is not None:
                timing.tokens = chunk.usage.completion_tokens
        timing.e2e = time.perf_counter() - t0
        return timing

    return submit


def raw_submit(client: Any, base_url: str, model: str) -> Submit:
    """The same request with httpx and json.loads per SSE line: a client that costs little CPU itself."""
    import json

    async def submit(prompt: list[int], max_tokens: int, t0: float) -> Timing:
        timing = Timing()
        body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
                "stream_options": {"include_usage": True}, "ignore_eos": True}
        async with client.stream("POST", f"{base_url}/completions", json=body) as response:
            if response.status_code != 200:
                raise RuntimeError(f"{base_url}: HTTP {response.status_code}: {(await response.aread())[:500]!r}")
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk["choices"] and (text := chunk["choices"][0]["text"]):
                    if math.isnan(timing.ttft):
                        timing.ttft = time.perf_counter() - t0
                    timing.text += text
                    timing.events += 1
                if chunk.get("usage"):
                    timing.tokens = chunk["usage"]["completion_tokens"]
        timing.e2e = time.perf_counter() - t0
        return timing

    return submit


_NULL_SSE = (b'data: {"id":"cmpl-0","object":"text_completion","created":0,"model":"m","choices":[{"text":"x",'
             b'"index":0,"logprobs":null,"finish_reason":"length"}],"usage":null}\n\ndata: [DONE]\n\n')


async def client_startup(make_submit: Callable[[str], Submit], prompts: Sequence[list[int]],
                         repeats: int = 3) -> float:
    """Seconds from a batch's start until its first request reached a server that does nothing (median of
    `repeats`): what the client alone spends before the engine can start. The openai client builds every request of
    a batch (~6 ms each for a token-id prompt here) before it sends the first, and an in-process engine pays nothing
    like it. `make_submit(base_url)` is the path's submit function against that server."""
    arrivals: list[float] = []

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        arrivals.append(time.perf_counter())
        length = next((int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                       if line.lower().startswith(b"content-length:")), 0)
        await reader.readexactly(length)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nconnection: close\r\n"
                     b"content-length: %d\r\n\r\n%s" % (len(_NULL_SSE), _NULL_SSE))
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(answer, "127.0.0.1", 0)
    try:
        submit = make_submit(f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/v1")
        firsts = []
        for _ in range(repeats):
            arrivals.clear()
            t0 = time.perf_counter()
            await asyncio.gather(*(submit(prompt, 1, t0) for prompt in prompts))
            firsts.append(min(arrivals) - t0)
        return median(firsts)
    finally:
        server.close()
        await server.wait_closed()


async def find_replica(gateway: str, model: str) -> tuple[str, list[dict[str, Any]]]:
    import httpx

    async with httpx.AsyncClient(timeout=30.0) as client:
        response = await client.get(f"{gateway}/models/{model}/info")
        response.raise_for_status()
        replicas = response.json()["replicas"]
    ready = [r for r in replicas if r["state"] == "ready" and r.get("url")]
    if not ready:
        raise RuntimeError(f"the gateway reports no ready replica of {model}: {replicas}")
    return ready[0]["url"].rstrip("/"), replicas


async def pin_one_replica(gateway: str, model: str) -> None:
    """Deploy the model again with min = max = 1 replica: one engine against the in-process one.

    The example's [scaling] lets the autoscaler start a second replica at 32 requests in flight (target
    concurrency 16): on a small machine it would load mid-run on the cores the first one uses, then split the
    batch between two engines. `ember serve --no-auth` leaves the admin API open.
    """
    import httpx

    async with httpx.AsyncClient(timeout=START_TIMEOUT_S) as client:
        response = await client.post(f"{gateway}/admin/deployments",
                                     json={"reference": model, "min_replicas": 1, "max_replicas": 1})
        if response.is_error:
            raise RuntimeError(f"could not pin {model} to one replica: HTTP {response.status_code}: "
                               f"{response.text[:500]}")


# --- statistics --------------------------------------------------------------------------------


def paired(a: Run, b: Run, attr: str) -> list[float]:
    """Per request: a's time minus b's (same lengths), in ms."""
    return [1e3 * (getattr(x, attr) - getattr(y, attr)) for x, y in zip(a.timings, b.timings, strict=True)]


def added(runs: dict[str, list[Run]], a: str, b: str) -> dict[str, list[float]]:
    """Per repeat: mean and median of the paired differences a - b, end to end and TTFT (ms)."""
    out: dict[str, list[float]] = {"e2e_mean": [], "e2e_median": [], "ttft_mean": [], "ttft_median": []}
    for run_a, run_b in zip(runs[a], runs[b], strict=True):
        for attr in ("e2e", "ttft"):
            diffs = paired(run_a, run_b, attr)
            out[f"{attr}_mean"].append(sum(diffs) / len(diffs))
            out[f"{attr}_median"].append(median(diffs))
    return out


def latency_ms(runs: list[Run], attr: str, stat: Callable[[list[float]], float]) -> list[float]:
    return [1e3 * stat([getattr(t, attr) for t in run.timings]) for run in runs]


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


# --- main --------------------------------------------------------------------------------------


async def bench(args: argparse.Namespace, server: Server, llm: Any, num_requests: int) -> dict[str, Any]:
    import httpx
    import openai

    from ember_platform.engine.async_engine import AsyncEngine

    aengine = AsyncEngine(llm.engine)
    clients: list[Any] = []
    try:
        gateway = server.wait_ready()
        client_kwargs = {"api_key": "none", "max_retries": 0, "timeout": RUN_TIMEOUT_S}
        gw_client = openai.AsyncOpenAI(base_url=f"{gateway}/v1", **client_kwargs)
        clients.append(gw_client)
        model = (await gw_client.models.list()).data[0].id
        await pin_one_replica(gateway, model)
        # The replica wants the gateway's secret; the gateway (--no-auth) ignores the header: both paths send one.
        raw_client = httpx.AsyncClient(timeout=RUN_TIMEOUT_S, limits=httpx.Limits(max_connections=None),
                                       headers={"Authorization": f"Bearer {REPLICA_SECRET}"})
        clients.append(raw_client)
        replica_url, replicas = await find_replica(gateway, model)
        server.replica_pids |= {r["pid"] for r in replicas if r.get("pid")}
        pids = {"gateway": server.proc.pid} if server.proc else {}
        pids.update(replica=next(r["pid"] for r in replicas if r["url"].rstrip("/") == replica_url))
        rep_client = openai.AsyncOpenAI(base_url=f"{replica_url}/v1", **{**client_kwargs, "api_key": REPLICA_SECRET})
        clients.append(rep_client)
        if args.client == "openai":
            http = {"gateway": openai_submit(gw_client, model), "replica": openai_submit(rep_client, model)}
        else:  # one httpx client, two pools of connections (one per host), like the two openai clients
            http = {"gateway": raw_submit(raw_client, f"{gateway}/v1", model),
                    "replica": raw_submit(raw_client, f"{replica_url}/v1", model)}
        submits = {"in-process": inprocess_submit(aengine), **http}
        tokenizer = llm.tokenizer
        workload = Workload.make(num_requests)

        # Warm-up: one batch per path with the same prompts (first-call costs, HTTP connections), and a check
        # that all three run the same model greedily: the texts should agree.
        n_warm = min(num_requests, 8)
        warm = Workload(workload.prompt_lens[:n_warm], [WARMUP_TOKENS] * n_warm)
        warm_prompts = warm.prompts(tokenizer, SEED - 1)
        last: dict[str, Run] = {}
        for name, submit in submits.items():
            last[name] = await run_batch(submit, warm_prompts, warm.output_lens)
        texts = {name: [t.text for t in run.timings] for name, run in last.items()}
        agreement = {name: sum(a == b for a, b in zip(texts[name], texts["in-process"], strict=True)) / n_warm
                     for name in ("gateway", "replica")}

        runs: dict[str, list[Run]] = {name: [] for name in PATHS}
        paused = 0.0
        for r in range(args.repeats):
            order = PATHS[r % len(PATHS):] + PATHS[:r % len(PATHS)]  # rotate: each path takes each place
            for name in order:
                prompts = workload.prompts(tokenizer, SEED + 100 * (r + 1) + PATHS.index(name))
                if name != "in-process":
                    paused += await settle_keepalive(last[name])
                engine_pid = os.getpid() if name == "in-process" else pids["replica"]
                run = last[name] = await run_batch(submits[name], prompts, workload.output_lens, pids, engine_pid)
                runs[name].append(run)
                cpu = "  ".join(f"{k} {v:.2f}" for k, v in run.cpu.items())
                eng = "  ".join(f"{k} {v:.2f}" for k, v in run.engine.items())
                print(f"  repeat {r + 1}/{args.repeats} {name:<10} {run.tok_s:7.1f} tok/s  wall {run.wall:6.2f} s  "
                      f"load {run.load:.2f}  CPU s: {cpu}  engine thread s: {eng}", flush=True)
        _, replicas_after = await find_replica(gateway, model)

        # The same batch's requests against a server that answers at once: when the first leaves the client.
        def make_submit(base_url: str) -> Submit:
            if args.client == "raw":
                return raw_submit(raw_client, base_url, "m")
            null_client = openai.AsyncOpenAI(base_url=base_url, **client_kwargs)
            clients.append(null_client)
            return openai_submit(null_client, "m")

        startup = await client_startup(make_submit, workload.prompts(tokenizer, SEED))
    finally:
        for client in clients:
            with contextlib.suppress(Exception):
                await (client.aclose() if isinstance(client, httpx.AsyncClient) else client.close())
        aengine.shutdown()
    return {"runs": runs, "workload": workload, "agreement": agreement, "replica_url": replica_url,
            "replicas": len(replicas_after), "model_name": model, "keepalive_pauses_s": round(paused, 1),
            "client_startup_s": startup}


def report(args: argparse.Namespace, out: dict[str, Any], num_requests: int) -> dict[str, Any]:
    runs: dict[str, list[Run]] = out["runs"]
    workload: Workload = out["workload"]
    tok_s = {name: [r.tok_s for r in runs[name]] for name in PATHS}
    med = {name: median(v) for name, v in tok_s.items()}
    ratio = med["gateway"] / med["in-process"]
    pair_ratios = [g / i for g, i in zip(tok_s["gateway"], tok_s["in-process"], strict=True)]
    loads = [r.load for name in PATHS for r in runs[name]]
    print(f"\nmodel {args.model}, client {args.client}, {args.threads} torch thread(s) here and in the replica "
          f"(OMP_NUM_THREADS={args.threads}, OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY')}); "
          f"{num_requests} requests at once, prompts {min(workload.prompt_lens)}..{max(workload.prompt_lens)}, "
          f"outputs {min(workload.output_lens)}..{max(workload.output_lens)} ({sum(workload.output_lens)} tokens); "
          f"{args.repeats} repeats, rotating order; 1-min load {min(loads):.1f}..{max(loads):.1f}\n")
    labels = {"in-process": "in-process (AsyncEngine)", "gateway": "gateway (ember serve)",
              "replica": "replica direct (HTTP)"}
    print_table(["path", "output tok/s: median [min..max]", "vs in-process", "E2E ms mean", "E2E ms median",
                 "TTFT ms median"],
                [[labels[name], spread(tok_s[name]), f"{med[name] / med['in-process']:.3f}",
                  f"{median(latency_ms(runs[name], 'e2e', _mean)):.0f}",
                  f"{median(latency_ms(runs[name], 'e2e', median)):.0f}",
                  f"{median(latency_ms(runs[name], 'ttft', median)):.0f}"] for name in PATHS])
    pairs = {"gateway_vs_inprocess": ("gateway", "in-process"), "replica_vs_inprocess": ("replica", "in-process"),
             "gateway_vs_replica": ("gateway", "replica")}
    added_ms = {key: added(runs, a, b) for key, (a, b) in pairs.items()}
    print("\nadded latency per request, ms (paired by request; median over repeats [min..max]):")
    print_table(["difference", "E2E mean", "E2E median", "TTFT mean", "TTFT median"],
                [[f"{a} - {b}", *(spread(added_ms[key][stat]) for stat in ("e2e_mean", "e2e_median", "ttft_mean",
                                                                           "ttft_median"))]
                 for key, (a, b) in pairs.items()])
    per_event = {name: median(sum(t.tokens for t in r.timings) / max(1, sum(t.events for t in r.timings))
                              for r in runs[name]) for name in PATHS}
    print("\noutput tokens per text event (engine output in-process, SSE chunk over HTTP), median: "
          + ", ".join(f"{name} {per_event[name]:.2f}" for name in PATHS))
    procs = ("this", "gateway", "replica")
    cpu = {name: {p: median(r.cpu.get(p, math.nan) for r in runs[name]) for p in procs} for name in PATHS}
    print("\nCPU seconds per run (median), by process; 'this' is the engine for in-process, the client otherwise:")
    print_table(["path", *procs, "total", "wall s"],
                [[labels[name], *(f"{cpu[name][p]:.2f}" for p in procs), f"{sum(cpu[name].values()):.2f}",
                  f"{median(r.wall for r in runs[name]):.2f}"] for name in PATHS])
    engine = {name: {k: median(r.engine.get(k, math.nan) for r in runs[name]) for k in ("cpu", "runq", "off")}
              for name in PATHS}
    med_wall = {name: median(r.wall for r in runs[name]) for name in PATHS}
    print("\nthe engine's step thread, seconds per run (median): on a CPU; runnable but waiting for a core (the "
          "client, the gateway, the replica's event loop or anything else on the machine had both); neither (waiting "
          "for the GIL, or for requests: over HTTP the first arrives only once the client has built all of them):")
    print_table(["path", "on CPU", "waiting for a core", "neither", "wall s"],
                [[labels[name], *(f"{engine[name][k]:.2f}" for k in ("cpu", "runq", "off")),
                  f"{median(r.wall for r in runs[name]):.2f}"] for name in PATHS])
    startup = out["client_startup_s"]
    print(f"\nclient start-up: a batch's first request leaves the {args.client} client {1e3 * startup:.0f} ms after "
          f"the batch starts (median of 3, against a server that answers at once): {startup / med_wall['gateway']:.1%} "
          "of the gateway path's median wall time, none of it the server's")
    met = ratio >= TARGET
    print(f"\nratio gateway/in-process output tok/s: {ratio:.3f} (pairs {', '.join(f'{x:.3f}' for x in pair_ratios)});"
          f" target >= {TARGET}: {'met' if met else 'MISSED'}; replica direct/in-process "
          f"{med['replica'] / med['in-process']:.3f}")
    if out["keepalive_pauses_s"]:
        print(f"paused {out['keepalive_pauses_s']:.1f} s in all before HTTP runs, clear of keep-alive expiry "
              "(see settle_keepalive)")
    agreement = out["agreement"]
    if min(agreement.values()) < 1.0:
        print(f"note: greedy texts differ from in-process on some warm-up requests: {agreement}")
    if out["replicas"] != 1:
        print(f"note: the gateway had {out['replicas']} replicas at the end; the comparison assumes one")
    return {
        "ratio": round(ratio, 3), "target": TARGET, "met": met,
        "inprocess_tok_s": round(med["in-process"], 1), "gateway_tok_s": round(med["gateway"], 1),
        "replica_tok_s": round(med["replica"], 1), "replica_ratio": round(med["replica"] / med["in-process"], 3),
        "pair_ratios": [round(x, 3) for x in pair_ratios],
        "added_ms": {key: {stat: round(median(v), 1) for stat, v in stats.items()} for key, stats in added_ms.items()},
        "cpu_s": {name: {p: round(v, 2) for p, v in cpu[name].items()} for name in PATHS},
        "engine_thread_s": {name: {k: round(v, 2) for k, v in engine[name].items()} for name in PATHS},
        "client_startup_ms": round(1e3 * startup, 1),
        "wall_s": {name: [round(r.wall, 3) for r in runs[name]] for name in PATHS},
        "e2e_ms_median": {name: round(median(latency_ms(runs[name], "e2e", median)), 1) for name in PATHS},
        "ttft_ms_median": {name: round(median(latency_ms(runs[name], "ttft", median)), 1) for name in PATHS},
        "tokens_per_event": {name: round(per_event[name], 2) for name in PATHS},
        "client": args.client,
        "workload": {"num_requests": num_requests, "prompt_len": list(PROMPT_LEN), "output_len": list(OUTPUT_LEN),
                     "prompt_tokens": sum(workload.prompt_lens), "output_tokens": sum(workload.output_lens),
                     "seed": SEED, "endpoint": "/v1/completions", "stream": True},
        "greedy_agreement": agreement, "replicas": out["replicas"], "keepalive_pauses_s": out["keepalive_pauses_s"],
        "load_avg_runs": [round(x, 2) for x in (min(loads), median(loads), max(loads))],
    }


def main() -> None:
    args = parse_args(__doc__.split("\n\n")[0], extra=add_flags)
    num_requests = args.requests or (8 if args.quick else 32)
    if num_requests < 1:
        raise SystemExit("--requests must be at least 1")
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    from ember_platform import LLM

    env_before = environment(args)
    with tempfile.TemporaryDirectory(prefix="ember-bench-gateway-") as tmp:
        server = Server(args.model.resolve(), args.threads, Path(tmp))
        try:
            server.launch()  # it starts while this process loads its own engine
            llm = LLM(args.model)
            out = asyncio.run(bench(args, server, llm, num_requests))
        except BaseException:
            print(f"ember serve failed or was interrupted{server.tail()}", file=sys.stderr)
            raise
        finally:
            server.stop()
    record = report(args, out, num_requests)
    env = environment(args)
    record.update(env, load_avg_start=env_before["load_avg"])
    name = args.model.resolve().name
    suffix = ("" if name == EXAMPLE_MODEL.name else f"-{name}") + ("" if args.client == "openai" else f"-{args.client}")
    emit(f"gateway{suffix}", record, args.results)


if __name__ == "__main__":
    main()
