"""The replica's app in-process (httpx.ASGITransport): readiness around loading, drain refusals, hooks, metrics."""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from ember.launch import ReplicaSpec
from ember_platform.replica import DRAINING, FAILED, READY, STARTING, Replica, create_app
from ember_platform.replica.__main__ import build_parser, parse_override
from ember_plugins.launchers.local import LocalProcessLauncher, default_replica_threads

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "tiny-llama"

HOOKS = '''
from ember import hookimpl


@hookimpl
def ember_preprocess_request(request, manifest):
    if request.get("max_tokens") == 999:
        return {**request, "max_tokens": 3}
    return None


@hookimpl
def ember_postprocess_output(output, request, manifest):
    return {**output, "text": f"[{len(output['token_ids'])} tokens, {output['finish_reason']}] " + output["text"]}
'''


@pytest.fixture(autouse=True)
def one_torch_thread() -> Iterator[None]:
    """The engines here run in the test process: one thread, since the machine's few cores are shared."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def client_for(replica: Replica) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=create_app(replica)), base_url="http://replica",
                             timeout=60)


CHAT = {"model": "tiny-llama", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "temperature": 0}


def test_ready_only_after_load_and_warm_up_and_not_while_draining() -> None:
    replica = Replica(EXAMPLE)

    async def main() -> None:
        async with client_for(replica) as http:
            assert (await http.get("/health")).json() == {"status": "ok"}
            ready = await http.get("/ready")
            assert ready.status_code == 503 and ready.json() == {"status": STARTING}
            info = (await http.get("/info")).json()
            assert info["state"] == STARTING and info["stats"] is None and info["name"] == "tiny-llama"
            assert info["timings"] == {"load": None, "quantize": None, "warmup": None, "first_token": None}
            early = await http.post("/v1/chat/completions", json=CHAT)
            assert early.status_code == 503 and early.headers["Retry-After"] == "1"
            assert "loading" in early.json()["error"]["message"]
            assert "ember_kv_blocks_total 0.0" in (await http.get("/metrics")).text

            await asyncio.to_thread(replica.load)
            assert replica.timings["warmup"] > 0 and replica.timings["first_token"] > 0
            ready = await http.get("/ready")
            assert ready.status_code == 200 and ready.json() == {"status": READY}
            answer = await http.post("/v1/chat/completions", json=CHAT)
            assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] <= 2
            metrics = (await http.get("/metrics")).text
            assert 'ember_cold_start_seconds{phase="warmup"}' in metrics
            assert 'ember_requests_finished_total{finish_reason="length"}' in metrics

            replica.begin_drain()
            assert (await http.get("/ready")).status_code == 503
            assert (await http.get("/info")).json()["state"] == DRAINING
            late = await http.post("/v1/completions", json={"model": "tiny-llama", "prompt": "Hi"})
            assert late.status_code == 503 and late.headers["Retry-After"] == "1"
            assert "shutting down" in late.json()["error"]["message"]
            assert (await http.get("/health")).status_code == 200

    try:
        asyncio.run(main())
    finally:
        replica.close()


def test_package_hooks_preprocess_requests_and_postprocess_outputs(tmp_path: Path) -> None:
    package = tmp_path / "hooked"
    package.mkdir()
    shutil.copy(EXAMPLE / "ember.toml", package / "ember.toml")
    (package / "weights").symlink_to(EXAMPLE / "weights")
    (package / "hooks.py").write_text(HOOKS)
    replica = Replica(package)
    assert replica.digest is None  # no ember.lock: not built

    async def main() -> None:
        await asyncio.to_thread(replica.load)
        async with client_for(replica) as http:
            body = {"model": "tiny-llama", "prompt": "Hi", "max_tokens": 999, "temperature": 0, "ignore_eos": True}
            out = (await http.post("/v1/completions", json=body)).json()
            assert out["usage"]["completion_tokens"] == 3
            assert out["choices"][0]["text"].startswith("[3 tokens, length] ")
            assert (await http.get("/info")).json()["digest"] is None

    try:
        asyncio.run(main())
    finally:
        replica.close()


def test_malformed_requests_get_openai_error_objects_before_any_generation() -> None:
    replica = Replica(EXAMPLE)
    replica.state = READY  # these bodies are refused before the engine is needed: it is never loaded

    async def main() -> None:
        async with client_for(replica) as http:
            bad = await http.post("/v1/chat/completions", content=b"{not json",
                                  headers={"Content-Type": "application/json"})
            assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid_json"
            array = await http.post("/v1/completions", json=[1, 2])
            assert array.status_code == 400 and "JSON object" in array.json()["error"]["message"]
            wrong_method = await http.get("/v1/completions")
            assert wrong_method.status_code == 405 and wrong_method.headers["Allow"] == "POST"
            assert wrong_method.json()["error"]["type"] == "invalid_request_error"
            unknown = await http.get("/v1/embeddings")
            assert unknown.status_code == 404 and "/v1/embeddings" in unknown.json()["error"]["message"]

    asyncio.run(main())


def test_every_app_has_its_own_metrics_registry() -> None:
    first, second = Replica(EXAMPLE), Replica(EXAMPLE)
    first.metrics.prompt_tokens.inc(5)
    assert "ember_prompt_tokens_total 5.0" in first.metrics.render()[0].decode()
    assert "ember_prompt_tokens_total 0.0" in second.metrics.render()[0].decode()


def test_a_misspelled_override_fails_before_anything_loads() -> None:
    with pytest.raises(TypeError, match="did you mean 'max_num_seqs'"):
        Replica(EXAMPLE, {"max_num_seq": 8})


def test_cli_overrides_are_json_when_they_can_be() -> None:
    assert parse_override("max_num_seqs=8") == ("max_num_seqs", 8)
    assert parse_override("enable_prefix_caching=false") == ("enable_prefix_caching", False)
    assert parse_override("quantization=int8") == ("quantization", "int8")
    assert parse_override('quantization_options={"bits": 4}') == ("quantization_options", {"bits": 4})
    with pytest.raises(argparse.ArgumentTypeError):
        parse_override("novalue")
    args = build_parser().parse_args(["--package", "p", "--override", "seed=1", "--override", "dtype=float32"])
    assert dict(args.override) == {"seed": 1, "dtype": "float32"} and args.drain_timeout == 30.0
    assert (args.host, args.port) == ("127.0.0.1", 0)


def test_a_crashed_engine_makes_the_replica_unhealthy_and_not_ready_with_the_error() -> None:
    replica = Replica(EXAMPLE)

    async def main() -> None:
        await asyncio.to_thread(replica.load)
        assert replica.engine is not None

        def crash() -> list:
            raise RuntimeError("simulated kernel failure")

        replica.engine.step = crash  # the next step the engine thread takes raises, and its loop stops
        async with client_for(replica) as http:
            # The request the engine died under was not answered: 503, so the gateway retries it on another replica.
            error = "the engine stopped after an internal error (the replica's log says which)"
            failed = await http.post("/v1/completions", json={"model": "tiny-llama", "prompt": "Hi", "max_tokens": 4})
            assert failed.status_code == 503 and error in failed.json()["error"]["message"]
            assert "RuntimeError" not in failed.text and "simulated" not in failed.text  # internals stay in the log
            ready = await http.get("/ready")
            assert ready.status_code == 503 and ready.json() == {"status": FAILED, "error": error}
            health = await http.get("/health")
            assert health.status_code == 503 and health.json() == {"status": "unhealthy", "error": error}
            info = (await http.get("/info")).json()
            assert info["state"] == FAILED and info["error"] == error
            # New requests are refused up front, as by a draining replica: the gateway sends them elsewhere.
            late = await http.post("/v1/chat/completions", json=CHAT)
            assert late.status_code == 503 and late.headers["Retry-After"] == "1"
            assert error in late.json()["error"]["message"]

    try:
        asyncio.run(main())
    finally:
        replica.close()


def test_the_launcher_leaves_a_core_to_the_http_side_unless_omp_num_threads_decides(tmp_path: Path) -> None:
    cores = len(os.sched_getaffinity(0))
    assert default_replica_threads({}) == max(1, cores - 1)
    assert default_replica_threads({"OMP_NUM_THREADS": "3"}) is None  # torch reads it itself
    spec = ReplicaSpec(deployment="tiny-llama", version="0.1.0", digest="sha256:" + "0" * 64, registry_url="reg",
                       replica_id="r1", secret="s")
    command = LocalProcessLauncher(log_dir=tmp_path, threads=3).command(spec)
    assert command[command.index("--threads") + 1] == "3"
    assert build_parser().parse_args(["--package", "p", "--threads", "3"]).threads == 3
