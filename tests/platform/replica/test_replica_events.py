"""The replica's SSE body, write by write: one write per engine output, the last one ending with `[DONE]`."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

from ember_platform.engine.outputs import RequestOutput as Output
from ember_platform.engine.outputs import Usage
from ember_platform.gateway.responses import SSE_DONE, ChatStream, CompletionStream
from ember_platform.replica.app import _events


class FakeReplica:
    """`generate_many` as the replica has it: (prompt index, output) pairs; or an error after the outputs."""

    def __init__(self, outputs: list[tuple[int, Output]], error: Exception | None = None) -> None:
        self.outputs = outputs
        self.error = error

    async def generate_many(self, prompts: list[list[int]], params: list[Any], request_id: str, *,
                            cache_salt: str | None = None, lora_name: str | None = None,
                            leaders: list[int | None] | None = None) -> AsyncIterator[tuple[int, Output]]:
        for item in self.outputs:
            yield item
        if self.error is not None:
            raise self.error


def _writes(replica: FakeReplica, stream: ChatStream | CompletionStream, prompts: int = 1) -> list[bytes]:
    async def collect() -> list[bytes]:
        return [write async for write in _events(replica, stream, [[1, 2, 3]] * prompts, [None] * prompts, None)]

    return asyncio.run(collect())


def _events_of(write: bytes) -> list[Any]:
    assert write.endswith(b"\n\n")
    return [line.removeprefix("data: ") if line == "data: [DONE]" else json.loads(line.removeprefix("data: "))
            for line in write.decode().split("\n\n") if line]


def test_completion_stream_one_write_per_output_and_done_with_the_last():
    outputs = [(0, Output("r", [1], "a", False, None, None, Usage(3, 1))),
               (0, Output("r", [2, 3], "bc", False, None, None, Usage(3, 3))),
               (0, Output("r", [4], "d", True, "length", None, Usage(3, 4)))]
    stream = CompletionStream(model="m", token_text=str, include_usage=True, completion_id="cmpl-1", created=0)
    writes = _writes(FakeReplica(outputs), stream)
    assert len(writes) == 3
    assert [e["choices"][0]["text"] for w in writes[:2] for e in _events_of(w)] == ["a", "bc"]
    last = _events_of(writes[-1])
    assert [e if e == "[DONE]" else e["choices"] and e["choices"][0]["finish_reason"] for e in last] == \
        [None, "length", [], "[DONE]"]  # text "d", the finish chunk, the usage chunk, [DONE]
    assert last[2]["usage"]["completion_tokens"] == 4
    assert writes[-1].endswith(SSE_DONE)


def test_two_choices_end_with_done_once_both_finished():
    outputs = [(0, Output("r-0", [1], "a", True, "stop", None, Usage(3, 1))),
               (1, Output("r-1", [2], "b", False, None, None, Usage(3, 1))),
               (1, Output("r-1", [3], "c", True, "length", None, Usage(3, 2)))]
    stream = CompletionStream(model="m", token_text=str, completion_id="cmpl-1", created=0, num_choices=2)
    writes = _writes(FakeReplica(outputs), stream, prompts=2)
    assert len(writes) == 3
    assert SSE_DONE not in writes[0] and SSE_DONE not in writes[1]
    assert writes[-1].endswith(SSE_DONE) and writes[-1].count(SSE_DONE) == 1


def test_chat_stream_role_chunk_first_then_done_with_the_finish():
    outputs = [(0, Output("r", [1], "hi", True, "stop", None, Usage(3, 1)))]
    stream = ChatStream(model="m", token_text=str, completion_id="chatcmpl-1", created=0)
    writes = _writes(FakeReplica(outputs), stream)
    assert len(writes) == 2
    assert _events_of(writes[0])[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    events = _events_of(writes[1])
    assert events[0]["choices"][0]["delta"] == {"content": "hi"}
    assert events[1]["choices"][0]["finish_reason"] == "stop"
    assert events[-1] == "[DONE]"


def test_an_error_mid_stream_is_one_error_event_then_done():
    outputs = [(0, Output("r", [1], "a", False, None, None, Usage(3, 1)))]
    stream = CompletionStream(model="m", token_text=str, completion_id="cmpl-1", created=0)
    writes = _writes(FakeReplica(outputs, RuntimeError("boom")), stream)
    assert len(writes) == 2
    error, done = _events_of(writes[-1])
    assert error["error"]["type"] == "server_error" and error["error"]["code"] == "internal_error"
    assert "boom" not in error["error"]["message"] and "RuntimeError" not in writes[-1].decode()  # in the log only
    assert done == "[DONE]"
