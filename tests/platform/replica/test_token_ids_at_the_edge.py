"""Every token id a client sends is checked against the model's vocabulary before the engine sees it (400 naming the
field), and a request that still fails in the engine fails alone: the replica serves on."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest

from ember_platform.replica import Replica, create_app

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "tiny-llama"
VOCAB = 4096  # examples/tiny-llama/weights/config.json


@pytest.fixture(scope="module")
def replica() -> Replica:
    import torch

    torch.set_num_threads(1)
    loaded = Replica(EXAMPLE)
    loaded.load()
    yield loaded
    loaded.close()


def _client(replica: Replica) -> httpx.AsyncClient:
    headers = {}
    secret = getattr(replica, "secret", None)  # replicas launched by a gateway require its secret
    if secret:
        headers["Authorization"] = f"Bearer {secret}"
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=create_app(replica)), base_url="http://replica",
                             timeout=60, headers=headers)


CASES = [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "min_tokens": 2,
                              "stop_token_ids": [3, VOCAB + 5]}, "stop_token_ids"),
    ("/v1/completions", {"prompt": "Hi", "min_tokens": 2, "stop_token_ids": [VOCAB]}, "stop_token_ids"),
    ("/v1/completions", {"prompt": [1, 2, VOCAB + 1]}, "prompt"),
    ("/v1/completions", {"prompt": [[1, 2], [3, -1]]}, "prompt"),
    ("/v1/completions", {"prompt": "Hi", "stop_token_ids": [-3]}, "stop_token_ids"),
]


@pytest.mark.parametrize(("path", "body", "param"), CASES)
def test_token_ids_outside_the_vocabulary_get_400_naming_the_field(replica: Replica, path: str, body: dict,
                                                                    param: str) -> None:
    async def main() -> None:
        async with _client(replica) as http:
            for stream in (False, True):
                bad = await http.post(path, json={"model": "tiny-llama", "max_tokens": 4, "stream": stream, **body})
                assert bad.status_code == 400, bad.text
                error = bad.json()["error"]
                assert error["type"] == "invalid_request_error" and error["param"].startswith(param), error
            good = await http.post("/v1/completions", json={"model": "tiny-llama", "prompt": "Hi", "max_tokens": 3,
                                                            "min_tokens": 2, "stop_token_ids": [VOCAB - 1]})
            assert good.status_code == 200 and good.json()["usage"]["completion_tokens"] >= 2

    asyncio.run(main())
    assert replica.failure is None


def test_many_hostile_requests_leave_the_engine_alive(replica: Replica) -> None:
    # The report: a few dozen such requests killed replicas one after another.
    async def main() -> None:
        async with _client(replica) as http:
            bad = {"model": "tiny-llama", "prompt": "Hi", "max_tokens": 4, "min_tokens": 3,
                   "stop_token_ids": [VOCAB * 10]}
            good = {"model": "tiny-llama", "prompt": "Hello", "max_tokens": 4}
            answers = await asyncio.gather(*(http.post("/v1/completions", json=bad if i % 2 else good)
                                             for i in range(40)))
            assert [a.status_code for a in answers] == [200, 400] * 20

    asyncio.run(main())
    assert replica.failure is None
