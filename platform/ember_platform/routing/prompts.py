"""The gateway's view of a request's prompt: its token ids and KV block hashes, computed as the replica will.

KV-aware routing needs the block hashes of the prompt *before* a replica sees it, so the gateway
tokenizes (and for chat, renders the chat template) with the package's own tokenizer files, then
hashes full blocks with the engine's hash spec (adapter name and cache salt included). Torch-free.
A prompt the gateway cannot turn into ids (a template error, an invalid shape) routes on load alone;
the replica then answers the request with the precise error.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ember.manifest import load_manifest
from ember_platform.engine.text import Tokenizer
from ember_platform.routing.router import request_block_hashes

log = logging.getLogger(__name__)

MAX_TOKEN_ID = 1 << 32  # block hashes pack token ids as uint32 (engine/block_hash.py)


class PromptHasher:
    """Token ids and block hashes of prompts for one package version."""

    def __init__(self, tokenizer: Tokenizer, block_size: int) -> None:
        self.tokenizer = tokenizer
        self.block_size = block_size

    @classmethod
    def for_package(cls, package_dir: str | Path) -> PromptHasher:
        return _hasher_for(str(Path(package_dir).resolve()))

    def completion_ids(self, prompt: str | Sequence[int]) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt)
        ids = [int(t) for t in prompt]
        if any(not 0 <= t < MAX_TOKEN_ID for t in ids):  # hashed as uint32; the replica says what is wrong with it
            raise ValueError("a token id is outside the range routing hashes")
        return ids

    def chat_ids(self, messages: Sequence[Any], tools: Sequence[Any] | None = None) -> list[int]:
        return self.tokenizer.chat_prompt_ids(messages, tools=tools)

    def block_hashes(self, token_ids: Sequence[int], *, lora: str | None = None,
                     salt: str | None = None) -> tuple[bytes, ...]:
        return request_block_hashes(token_ids, self.block_size, lora=lora, salt=salt)

    def request_ids(self, body: Any) -> list[int] | None:
        """Prompt ids of a parsed chat or completion request (the gateway's protocol objects), or None.

        A completion with several prompts routes on its first one: they go to one replica together.
        """
        try:
            if hasattr(body, "template_messages"):
                return self.chat_ids(body.template_messages(), tools=body.template_tools())
            prompts = body.prompts()
            return self.completion_ids(prompts[0]) if prompts else None
        except Exception as e:  # the replica reports the real error; routing falls back to load alone
            log.debug("cannot tokenize a request for routing: %s", e)
            return None


@functools.lru_cache(maxsize=64)
def _hasher_for(package_dir: str) -> PromptHasher:
    manifest = load_manifest(Path(package_dir))
    tokenizer = Tokenizer.from_dir(Path(package_dir) / manifest.model.weights)
    return PromptHasher(tokenizer, manifest.runtime.kv_block_size)
