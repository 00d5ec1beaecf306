"""Output hooks on streams, end to end: README's redaction plugin installed for real, a real replica process, `ember
serve` and `ember call`, and the official `openai` client. The model is a real checkpoint made here whose greedy
answer is known: " Mail bob@example.com now\\n" over and over, the address spread over six tokens, so every stream
carries it across chunks."""

from __future__ import annotations

import asyncio
import json
import os
import queue
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest

REPO = Path(__file__).resolve().parents[3]
EXAMPLE = REPO / "examples" / "tiny-llama"
MODEL = "mailer"
ANSWER = " Mail bob@example.com now\n"  # what the model says, again and again
REDACTED = " Mail [email] now\n"
TOKENS_PER_ANSWER = 10
SECRETS = ("bob", "@", "example")  # no chunk may carry any piece of the address
SECRET = "replica-secret-for-tests"  # sent to replicas that require one; ignored by those that do not
START_TIMEOUT = 120.0


def write_mailer(dest: Path) -> Path:
    """A one-layer Llama on tiny-llama's tokenizer that repeats ANSWER: attention and MLP write nothing, so each token's
    logits are its embedding through lm_head, which maps every token of ANSWER to the next one (and any other to the
    first)."""
    from safetensors.numpy import save_file

    from ember_platform.engine.text.tokenizer import Tokenizer

    weights = dest / "weights"
    weights.mkdir(parents=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(EXAMPLE / "weights" / name, weights / name)
    config = json.loads((EXAMPLE / "weights" / "config.json").read_text())
    hidden, inter, head_dim = 64, 128, 32
    config.update(hidden_size=hidden, intermediate_size=inter, num_hidden_layers=1, num_attention_heads=2,
                  num_key_value_heads=1, head_dim=head_dim)
    (weights / "config.json").write_text(json.dumps(config, indent=2))
    ids = Tokenizer.from_dir(weights).encode(ANSWER, add_special_tokens=False)
    assert len(ids) == TOKENS_PER_ANSWER == len(set(ids)), ids  # each token has one successor
    assert ids[2:8] == Tokenizer.from_dir(weights).encode(" bob@example.com", add_special_tokens=False)  # 6 tokens
    vocab = config["vocab_size"]
    embed = np.zeros((vocab, hidden), np.float32)
    embed[:, 0] = 1.0  # every token outside ANSWER: direction 0
    lm_head = np.zeros((vocab, hidden), np.float32)
    lm_head[ids[0], 0] = 10.0
    for position, token in enumerate(ids):
        embed[token] = 0.0
        embed[token, position + 1] = 1.0
        lm_head[ids[(position + 1) % len(ids)], position + 1] = 10.0

    def zeros(*shape: int) -> np.ndarray:
        return np.zeros(shape, np.float32)

    layer = "model.layers.0."
    save_file({
        "model.embed_tokens.weight": embed, "lm_head.weight": lm_head, "model.norm.weight": np.ones(hidden, np.float32),
        layer + "input_layernorm.weight": np.ones(hidden, np.float32),
        layer + "post_attention_layernorm.weight": np.ones(hidden, np.float32),
        layer + "self_attn.q_proj.weight": zeros(2 * head_dim, hidden),
        layer + "self_attn.k_proj.weight": zeros(head_dim, hidden),
        layer + "self_attn.v_proj.weight": zeros(head_dim, hidden),
        layer + "self_attn.o_proj.weight": zeros(hidden, 2 * head_dim),
        layer + "mlp.gate_proj.weight": zeros(inter, hidden), layer + "mlp.up_proj.weight": zeros(inter, hidden),
        layer + "mlp.down_proj.weight": zeros(hidden, inter),
    }, str(weights / "model.safetensors"))
    (dest / "ember.toml").write_text(f'[model]\nname = "{MODEL}"\nversion = "0.1.0"\n\n'
                                     '[runtime]\nmax_model_len = 2048\n\n'
                                     '[scaling]\nmin_replicas = 1\nmax_replicas = 1\n')
    return dest


@pytest.fixture(scope="module")
def mailer(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_mailer(tmp_path_factory.mktemp("mailer") / "mailer")


@pytest.fixture(scope="module")
def redact_env(plugin_dists: dict[str, Path]) -> dict[str, str]:
    """The environment of processes that see README's plugin installed (as `pip install ./ember-redact` would)."""
    env = {key: value for key, value in os.environ.items() if key != "EMBER_DISABLE_PLUGINS"}
    path = os.pathsep.join(p for p in (str(plugin_dists["redact"]), env.get("PYTHONPATH")) if p)
    return {**env, "PYTHONPATH": path, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "EMBER_REPLICA_SECRET": SECRET}


class Process:
    """A subprocess whose stdout lines are read in the background; `wait_for(prefix)` returns the first such line."""

    def __init__(self, args: list[str], env: dict[str, str], log: Path) -> None:
        self.log = log
        with log.open("w") as out:
            self.proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=out, text=True,
                                         env=env, cwd=REPO)
        self.lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line.rstrip("\n"))

    def wait_for(self, prefix: str, timeout: float = START_TIMEOUT) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                line = self.lines.get(timeout=0.2)
            except queue.Empty:
                if self.proc.poll() is not None:
                    break
                continue
            if line.startswith(prefix):
                return line.split()[1].rstrip("/")
        pytest.fail(f"no '{prefix}' line (exit code {self.proc.poll()}):\n{self.log.read_text()[-4000:]}")


@pytest.fixture(scope="module")
def replica(mailer: Path, redact_env: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real replica process of the mailer package with the redaction plugin installed: its URL."""
    log = tmp_path_factory.mktemp("replica") / "replica.log"
    process = Process([sys.executable, "-m", "ember_platform.replica", "--package", str(mailer), "--port", "0",
                       "--threads", "1", "--log-level", "warning"], redact_env, log)
    try:
        yield process.wait_for("EMBER_REPLICA_READY ")
    finally:
        process.proc.kill()
        process.proc.wait(15)


@pytest.fixture(scope="module")
def served(mailer: Path, redact_env: dict[str, str], tmp_path_factory: pytest.TempPathFactory,
           stop_serve: Callable[..., None]) -> Iterator[tuple[str, dict[str, str]]]:
    """`ember serve` of the mailer package (gateway, control plane, a replica process), the plugin installed: its
    URL and environment."""
    tmp = tmp_path_factory.mktemp("serve")
    env = {**redact_env, "EMBER_HOME": str(tmp / "home"), "EMBER_REGISTRY": str(tmp / "registry"),
           "EMBER_CACHE": str(tmp / "cache")}
    process = Process([sys.executable, "-m", "ember", "serve", str(mailer), "--no-auth", "--host", "127.0.0.1",
                       "--port", "0"], env, tmp / "serve.log")
    pids: set[int] = set()
    try:
        url = process.wait_for("EMBER_SERVE_READY ")
        pids.update(r["pid"] for r in httpx.get(f"{url}/admin/deployments/{MODEL}", timeout=30).json()["replicas"]
                    if r["pid"])
        yield url, env
    finally:
        stop_serve(process.proc, pids, tmp / "home")


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=SECRET, max_retries=0, timeout=60)


def streamed_chat(url: str, max_tokens: int) -> tuple[list[str], list[openai.types.chat.ChatCompletionChunk]]:
    chunks = list(client(url).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=max_tokens, stream=True,
        stream_options={"include_usage": True}))
    return [c.choices[0].delta.content or "" for c in chunks if c.choices], chunks


def assert_redacted(pieces: list[str], answers: int) -> None:
    leaked = [piece for piece in pieces if any(secret in piece for secret in SECRETS)]
    assert not leaked, f"chunks carrying the address: {leaked}"
    assert "".join(pieces) == REDACTED * answers
    # How many chunks carry text is timing: a replica merges the deltas a slow reader has not taken yet. That the
    # filter releases text as soon as it is safe, for every way of cutting it, is test_hook_ember_postprocess_stream's.


def serve_hooked_mailer(mailer: Path, dest: Path, hooks: str,
                        check: Callable[[httpx.AsyncClient], Awaitable[None]]) -> None:
    """Runs `check` against an in-process replica of the mailer package with `hooks` as its hooks.py."""
    import torch

    from ember_platform.replica import Replica, create_app

    dest.mkdir()
    shutil.copy(mailer / "ember.toml", dest / "ember.toml")
    (dest / "weights").symlink_to(mailer / "weights")
    (dest / "hooks.py").write_text(hooks)
    replica = Replica(dest)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)

    async def main() -> None:
        await asyncio.to_thread(replica.load)
        transport = httpx.ASGITransport(app=create_app(replica))
        async with httpx.AsyncClient(transport=transport, base_url="http://replica", timeout=60) as http:
            await check(http)

    try:
        asyncio.run(main())
    finally:
        replica.close()
        torch.set_num_threads(threads)


# --- a real replica ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("answers", [1, 3])
def test_a_streamed_chat_never_carries_the_address_in_any_chunk(replica: str, answers: int) -> None:
    pieces, chunks = streamed_chat(replica, TOKENS_PER_ANSWER * answers)
    assert_redacted(pieces, answers)
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finish == ["length"]
    assert chunks[-1].usage.completion_tokens == TOKENS_PER_ANSWER * answers  # the model's count, not the text's
    # the same answer unstreamed: redacted as it always was
    reply = client(replica).chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                                    max_tokens=TOKENS_PER_ANSWER * answers)
    assert reply.choices[0].message.content == "".join(pieces)
    assert reply.usage.completion_tokens == TOKENS_PER_ANSWER * answers


def test_a_streamed_completion_of_two_prompts_never_carries_the_address(replica: str) -> None:
    body = {"model": MODEL, "prompt": ["Hi", "Hello there"], "max_tokens": 2 * TOKENS_PER_ANSWER, "stream": True}
    pieces: dict[int, list[str]] = {0: [], 1: []}
    with httpx.stream("POST", f"{replica}/v1/completions", json=body, timeout=60,
                      headers={"Authorization": f"Bearer {SECRET}"}) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            assert not any(secret in line for secret in SECRETS), line  # not in any event, choice or error
            if line.startswith("data: {"):
                for choice in json.loads(line.removeprefix("data: "))["choices"]:
                    pieces[choice["index"]].append(choice["text"])
    assert_redacted(pieces[0], 2)
    assert_redacted(pieces[1], 2)
    unstreamed = client(replica).completions.create(model=MODEL, prompt=["Hi", "Hello there"],
                                                    max_tokens=2 * TOKENS_PER_ANSWER)
    assert [c.text for c in unstreamed.choices] == [REDACTED * 2] * 2


def test_logprobs_are_refused_while_an_output_hook_rewrites_the_text(replica: str) -> None:
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as info:
            client(replica).chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                                    max_tokens=4, logprobs=True, stream=stream)
        error = info.value.body
        assert error["param"] == "logprobs" and "plugin 'redact'" in error["message"], error
        assert not any(secret in json.dumps(error) for secret in SECRETS)


# --- `ember serve` and `ember call` --------------------------------------------------------------------------------


def test_streams_through_ember_serve_are_redacted(served: tuple[str, dict[str, str]]) -> None:
    url, _ = served
    pieces, chunks = streamed_chat(url, 2 * TOKENS_PER_ANSWER)
    assert_redacted(pieces, 2)
    assert chunks[-1].usage.completion_tokens == 2 * TOKENS_PER_ANSWER
    stream = client(url).completions.create(model=MODEL, prompt="Hi", max_tokens=TOKENS_PER_ANSWER, stream=True)
    assert_redacted([c.choices[0].text for c in stream if c.choices], 1)


@pytest.mark.parametrize("mode", ["--chat", "--completion"])
def test_ember_call_prints_the_redacted_answer(served: tuple[str, dict[str, str]], mode: str) -> None:
    url, env = served
    done = subprocess.run([sys.executable, "-m", "ember", "call", MODEL, "Hi", "--gateway", url, "--max-tokens",
                           str(2 * TOKENS_PER_ANSWER), mode], env=env, capture_output=True, text=True, timeout=120,
                          cwd=REPO)
    assert done.returncode == 0, done.stderr
    assert done.stdout == REDACTED * 2 + "\n"


# --- a plugin that has only the whole-output hook: the stream is held back, then rewritten whole -----------------


WHOLE_OUTPUT_HOOKS = '''
from ember import hookimpl


@hookimpl
def ember_postprocess_output(output, request, manifest):
    if "@" in output["text"]:
        return {**output, "text": "[withheld]", "finish_reason": "content_filter"}
    return None
'''


def test_a_whole_output_hook_holds_the_stream_back_and_its_finish_reason_ends_it(mailer: Path,
                                                                                 tmp_path: Path) -> None:
    async def check(http: httpx.AsyncClient) -> None:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 12,
                "stream": True, "stream_options": {"include_usage": True}}
        events = []
        async with http.stream("POST", "/v1/chat/completions", json=body) as response:
            async for line in response.aiter_lines():
                if line.startswith("data: {"):
                    events.append(json.loads(line.removeprefix("data: ")))
        deltas = [e["choices"][0]["delta"].get("content") for e in events if e["choices"]]
        assert deltas == ["", "[withheld]", None]  # role chunk, the rewrite, the finish chunk
        assert [e["choices"][0]["finish_reason"] for e in events if e["choices"]][-1] == "content_filter"
        assert events[-1]["usage"]["completion_tokens"] == 12
        whole = (await http.post("/v1/chat/completions", json={**body, "stream": False,
                                                                 "stream_options": None})).json()
        assert whole["choices"][0]["message"]["content"] == "[withheld]"
        assert whole["choices"][0]["finish_reason"] == "content_filter"

    serve_hooked_mailer(mailer, tmp_path / "hooked", WHOLE_OUTPUT_HOOKS, check)


FAILING_FILTER_HOOKS = '''
from ember import hookimpl


class Fails:
    def feed(self, text):
        return text if "@" not in text else 1 / 0

    def flush(self, finish_reason):
        return ""


@hookimpl
def ember_postprocess_stream(request, manifest):
    if request.get("user") == "broken-hook":
        raise LookupError("no filter today")
    return Fails()
'''


def test_a_failing_output_hook_is_an_openai_error_naming_the_hook_not_the_exception(mailer: Path,
                                                                                   tmp_path: Path) -> None:
    def assert_clean(error: dict) -> None:
        assert set(error) == {"message", "type", "param", "code"} and error["type"] == "server_error", error
        assert "package hooks.py" in error["message"], error
        assert not any(name in error["message"] for name in ("ZeroDivisionError", "LookupError", "Traceback"))

    async def check(http: httpx.AsyncClient) -> None:
        body = {"model": MODEL, "prompt": "Hi", "max_tokens": 12}
        async with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as response:
            assert response.status_code == 200
            lines = [line async for line in response.aiter_lines() if line]
        assert lines[-1] == "data: [DONE]" and not any("bob" in line for line in lines)
        assert_clean(json.loads(lines[-2].removeprefix("data: "))["error"])  # the error event, then [DONE]
        whole = await http.post("/v1/completions", json=body)
        assert whole.status_code == 500
        assert_clean(whole.json()["error"])
        refused = await http.post("/v1/completions", json={**body, "stream": True, "user": "broken-hook"})
        assert refused.status_code == 500
        assert_clean(refused.json()["error"])
        # the replica serves on
        assert (await http.post("/v1/completions", json={**body, "max_tokens": 2})).status_code == 200

    serve_hooked_mailer(mailer, tmp_path / "failing", FAILING_FILTER_HOOKS, check)
