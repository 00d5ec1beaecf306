"""The gateway hashes a prompt's blocks exactly as the engine's prefix cache does (the example package)."""

from __future__ import annotations

import sys
from pathlib import Path

from ember_platform.routing.prompts import PromptHasher

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "tiny-llama"
CODE = "import os\n\ndef walk(top):\n    for root, dirs, files in os.walk(top):\n        yield root, files\n" * 6


def test_block_hashes_equal_the_engines_prefix_cache_hashes() -> None:
    from ember_platform import LLM, SamplingParams

    hasher = PromptHasher.for_package(EXAMPLE)
    ids = hasher.completion_ids(CODE)
    assert len(ids) >= 3 * hasher.block_size
    llm = LLM(EXAMPLE)
    engine = llm.engine
    req = engine.add_request("r", ids, SamplingParams(max_tokens=1), lora_name=None)
    while engine.has_unfinished():
        engine.step()
    # The engine's request carries the hash chain of its full blocks; the gateway's must be identical.
    assert list(hasher.block_hashes(ids)) == list(req.block_hashes[:len(ids) // hasher.block_size])
    assert hasher.block_hashes(ids, lora="sql") != hasher.block_hashes(ids)


def test_chat_ids_use_the_packages_template_and_bad_requests_route_on_load() -> None:
    hasher = PromptHasher.for_package(EXAMPLE)

    class Chat:
        def template_messages(self) -> list[dict[str, str]]:
            return [{"role": "user", "content": "def add(a, b):"}]

        def template_tools(self) -> None:
            return None

    class Broken:
        def prompts(self) -> list[object]:
            raise ValueError("not a prompt")

    ids = hasher.request_ids(Chat())
    assert ids == hasher.chat_ids([{"role": "user", "content": "def add(a, b):"}])
    assert hasher.request_ids(Broken()) is None


def test_the_gateway_side_does_not_import_torch() -> None:
    import subprocess

    code = ("import sys; from ember_platform.routing.prompts import PromptHasher; "
            f"PromptHasher.for_package({str(EXAMPLE)!r}).completion_ids('x'); print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_token_ids_routing_cannot_hash_route_on_load_instead_of_failing() -> None:
    # Found by tests/fuzz: ids past uint32 (or a C long) made the gateway's block hashing raise: a 500.
    from types import SimpleNamespace

    hasher = PromptHasher.for_package(EXAMPLE)
    for ids in ([1] * 15 + [2**32], [1] * 15 + [2**70], [-1] * 16):
        assert hasher.request_ids(SimpleNamespace(prompts=lambda ids=ids: [ids])) is None
    assert hasher.request_ids(SimpleNamespace(prompts=lambda: [[1] * 16])) == [1] * 16
