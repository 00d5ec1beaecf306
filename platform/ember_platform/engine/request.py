"""A request's state inside the engine: its tokens, progress, blocks and block hashes."""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING

from ember_platform.engine.block_hash import ROOT_PARENT, BlockHash, extra_keys, hash_block

if TYPE_CHECKING:
    from ember_platform.engine.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"  # EOS, a stop token id or a stop string
    FINISHED_LENGTH = "length"  # max_tokens or the model's context
    FINISHED_ABORTED = "abort"  # the client went away
    FINISHED_ERROR = "error"  # the engine failed on this request (its output says why); the others go on

    @property
    def finished(self) -> bool:
        return self in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH,
                        RequestStatus.FINISHED_ABORTED, RequestStatus.FINISHED_ERROR)


class Request:
    """One sequence being generated. Token ids = prompt + output; KV exists for the first
    `num_computed_tokens` of them."""

    __slots__ = ("_extra", "arrival", "block_hashes", "block_ids", "cache_salt", "finish_reason",
                 "lora_name", "num_cached_tokens", "num_computed_tokens", "num_preemptions", "num_shared_tokens",
                 "output_token_ids", "params", "prefill_leader", "prompt_logprobs", "prompt_token_ids", "request_id",
                 "spec_parents", "spec_token_ids", "status", "stop_reason")

    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, arrival: int,
                 *, lora_name: str | None = None, cache_salt: str | None = None,
                 prefill_leader: Request | None = None, num_shared_tokens: int = 0,
                 prompt_logprobs: bool = False) -> None:
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.params = params
        self.arrival = arrival  # monotonic submission order: FCFS and preemption order
        self.lora_name = lora_name
        self.cache_salt = cache_salt
        self._extra = extra_keys(lora_name, cache_salt)
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0  # prompt tokens served from the prefix cache (first schedule)
        self.num_preemptions = 0
        self.block_ids: list[int] = []
        self.block_hashes: list[BlockHash] = []
        self.spec_token_ids: list[int] = []  # proposed by a speculator, verified next step
        # Tree drafts (spec_tree.py): each draft's parent, of which the first len(spec_token_ids) apply (a prefix of
        # a tree is a tree, so cutting spec_token_ids keeps it valid); None for chains. The scheduler never reads it.
        self.spec_parents: list[int] | None = None
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        # A sibling (same prompt, adapter and salt: one of a request's n choices) whose prefill this one waits for,
        # so that it reads the prompt's full blocks from the prefix cache instead of computing them again.
        self.prefill_leader = prefill_leader
        self.num_shared_tokens = num_shared_tokens  # the prompt's tokens in whole blocks before its last token
        # Its prompt's logprobs are wanted: every prompt position's logits, so nothing is read from the prefix cache.
        self.prompt_logprobs = prompt_logprobs

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_tokens_with_spec(self) -> int:
        return self.num_tokens + len(self.spec_token_ids)

    @property
    def spec_tree(self) -> list[int] | None:
        """The parents of the scheduled drafts when they form a tree that is not a chain, else None."""
        parents = self.spec_parents
        if parents is None or not self.spec_token_ids:
            return None
        parents = parents[:len(self.spec_token_ids)]
        return None if all(p == i - 1 for i, p in enumerate(parents)) else parents

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def waits_for_prefill(self) -> bool:
        """Whether its leader is still computing the prompt's whole blocks (scheduling this one would compute them
        twice). Blocks a leader computed or found are in the prefix cache by the time its count says so."""
        leader = self.prefill_leader
        if leader is None:
            return False
        if leader.status.finished or leader.num_computed_tokens >= self.num_shared_tokens:
            self.prefill_leader = None  # done waiting: let the leader's state go
            return False
        return True

    def token_at(self, i: int) -> int:
        n = len(self.prompt_token_ids)
        return self.prompt_token_ids[i] if i < n else self.output_token_ids[i - n]

    def update_block_hashes(self, block_size: int) -> None:
        """Hash every newly full block (prompt and output alike), chained from the last one."""
        tokens = None
        while (len(self.block_hashes) + 1) * block_size <= self.num_tokens:
            tokens = tokens or self.all_token_ids
            start = len(self.block_hashes) * block_size
            parent = self.block_hashes[-1] if self.block_hashes else ROOT_PARENT
            self.block_hashes.append(hash_block(parent, tokens[start:start + block_size], self._extra))

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, {self.status.value}, prompt={self.num_prompt_tokens}, "
                f"out={len(self.output_token_ids)}, computed={self.num_computed_tokens})")
