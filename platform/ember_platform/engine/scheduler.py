"""The scheduler: which requests run in the next step, and how many tokens each.

vLLM v1 style, without separate prefill and decode phases: every request simply has tokens
whose KV is not computed yet (a prompt, a prompt's remainder, one new token, or one new
token plus speculative ones). Each step has a token budget. Running requests go first, in
arrival order — their decode (and speculative) tokens, or the next chunk of a prefill —
then waiting requests, first come first served, chunked to what is left of the budget.
When blocks run out, the newest running request is preempted (its blocks freed, to be
recomputed later); being newest-first and FCFS, the oldest request always progresses.

Siblings (the n choices of one prompt) share one prefill: a request with a `prefill_leader` waits until the leader
has computed the prompt, then finds its full blocks in the prefix cache and computes only the last partial block.
Other requests go ahead meanwhile.

A request for a LoRA adapter is admitted only once its adapter holds a device slot (`LoRASlots.acquire`).
Running requests pin their adapters. When no slot can be had, that request waits and so does every later
request for an adapter (they would keep the slots busy and starve it); requests without one go ahead.
"""

from __future__ import annotations

import contextlib
import logging
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Protocol

from ember_platform.engine.kv_cache_manager import KVCacheManager
from ember_platform.engine.request import Request, RequestStatus

log = logging.getLogger("ember.engine")


class LoRALoadError(RuntimeError):
    """An adapter that was fine when registered could not be read when it was needed (its files changed)."""


class LoRASlots(Protocol):
    """What the scheduler needs from the LoRA manager (defined here so that the scheduler stays torch-free)."""

    def acquire(self, name: str, in_use: Iterable[str]) -> bool:
        """Make adapter `name` resident (evicting an idle one if need be); False if every slot is in use.
        Raises LoRALoadError if the adapter cannot be read: that request fails, the engine goes on."""
        ...


@dataclass(slots=True)
class ScheduledBatch:
    """One step's work: requests in batch order with the number of tokens each computes."""

    requests: list[Request] = field(default_factory=list)
    num_tokens: list[int] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    refused: list[Request] = field(default_factory=list)  # finished unscheduled: too long for the whole pool

    @property
    def total_tokens(self) -> int:
        return sum(self.num_tokens)

    def __len__(self) -> int:
        return len(self.requests)


class Scheduler:
    def __init__(self, kv: KVCacheManager, *, max_num_seqs: int, max_num_batched_tokens: int,
                 max_model_len: int, lora: LoRASlots | None = None) -> None:
        self.kv = kv
        self.lora = lora
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.waiting: deque[Request] = deque()
        self.num_loading = 0  # waiting requests the last step skipped while their prefix was read from a tier
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}

    # --- queue management -----------------------------------------------------------------

    def add(self, req: Request) -> None:
        self.requests[req.request_id] = req
        self.waiting.append(req)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def finish(self, req: Request, status: RequestStatus) -> None:
        """Finish (or abort) a request and free its blocks at once."""
        if req.status.finished:
            return
        if req.status == RequestStatus.RUNNING:
            self.running.remove(req)
        else:
            with contextlib.suppress(ValueError):
                self.waiting.remove(req)
        req.status = status
        req.finish_reason = status.value
        req.spec_token_ids = []
        self.kv.free(req)
        self.requests.pop(req.request_id, None)

    # --- one step -------------------------------------------------------------------------

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.max_num_batched_tokens
        self.running.sort(key=lambda r: r.arrival)
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            num_new = req.num_tokens_with_spec - req.num_computed_tokens
            if num_new > budget and req.spec_token_ids:
                # Drop speculative tokens that do not fit rather than delaying the request.
                keep = max(0, len(req.spec_token_ids) - (num_new - budget))
                req.spec_token_ids = req.spec_token_ids[:keep]
                num_new = req.num_tokens_with_spec - req.num_computed_tokens
            num_new = min(num_new, budget)
            while not self.kv.allocate_slots(req, num_new):
                victim = self.running[-1]  # newest (the list is in arrival order)
                self._preempt(victim)
                batch.preempted.append(victim)
                if victim is req:
                    break
            else:
                batch.requests.append(req)
                batch.num_tokens.append(num_new)
                budget -= num_new
                i += 1
        if batch.preempted:
            return batch  # blocks are short: admit nobody new this step
        in_use = {r.lora_name for r in self.running if r.lora_name}
        lora_blocked: list[Request] = []  # skipped for want of an adapter slot, in queue order
        loading: list[Request] = []  # skipped while their prefix is read from a lower KV tier
        held: list[Request] = []  # skipped while a sibling computes their shared prompt
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            if req.waits_for_prefill:
                held.append(self.waiting.popleft())
                continue
            if req.lora_name is not None and self.lora is not None \
                    and not self._acquire_lora(req, in_use, lora_blocked, batch):
                continue
            # Prompt logprobs need the logits of every prompt position: nothing of the prompt may come from the cache.
            computed = ([], 0) if req.prompt_logprobs else self.kv.get_computed_blocks(req)
            if computed is None:
                loading.append(self.waiting.popleft())
                continue
            hits, num_hit_tokens = computed
            num_new = min(req.num_tokens - num_hit_tokens, budget)
            if not self.kv.allocate_slots(req, num_new, hits):
                if not self.running and self.kv.blocks_needed(req.num_tokens) > self.kv.num_blocks:
                    self.waiting.popleft()  # can never fit, even alone: fail it rather than stall
                    self.finish(req, RequestStatus.FINISHED_LENGTH)
                    batch.refused.append(req)
                    continue
                break
            self.waiting.popleft()
            if req.status == RequestStatus.WAITING:
                req.num_cached_tokens = num_hit_tokens
                self.kv.record_lookup(req.num_tokens, num_hit_tokens)
            req.num_computed_tokens = num_hit_tokens
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            batch.requests.append(req)
            batch.num_tokens.append(num_new)
            budget -= num_new
            if req.lora_name is not None:
                in_use.add(req.lora_name)
        # Back to the front, in arrival order: first come, first served once their adapter or prefix is there.
        self.waiting.extendleft(sorted(lora_blocked + loading + held, key=lambda r: r.arrival, reverse=True))
        self.num_loading = len(loading)
        return batch

    def _acquire_lora(self, req: Request, in_use: set[str], lora_blocked: list[Request],
                      batch: ScheduledBatch) -> bool:
        """Whether the head of the queue, a request for an adapter, may be admitted now; if not, it is
        taken off the queue (into `lora_blocked`, put back after this step, or refused if its adapter
        cannot be read)."""
        assert req.lora_name is not None and self.lora is not None
        try:
            ok = not lora_blocked and self.lora.acquire(req.lora_name, in_use)
        except LoRALoadError as e:  # its files changed since it was registered: fail this request, not the engine
            log.error("request %s: %s", req.request_id, e)
            self.waiting.popleft()
            self.finish(req, RequestStatus.FINISHED_ABORTED)
            batch.refused.append(req)
            return False
        if not ok:
            lora_blocked.append(self.waiting.popleft())
        return ok

    def _preempt(self, req: Request) -> None:
        """Free a running request's blocks; it goes back to the front of the queue to be recomputed."""
        self.running.remove(req)
        self.kv.free(req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.spec_token_ids = []
        req.num_preemptions += 1
        # Older than anything waiting (it was admitted before them): keep FCFS order.
        self.waiting.appendleft(req)
