"""KV-prefix-, LoRA- and load-aware choice of a replica for each request, through the routing tables.

The gateway turns a request into its prompt's KV block hashes (`routing.prompts.PromptHasher`, the
package's own tokenizer and chat template, the engine's hash spec) and asks the `Router` for the
replica whose cost (uncached prefill tokens + load + adapter loading) is lowest within the
imbalance bound; the reservation it takes is released when the response ends.

Two sources of truth, one code path:

- **Redis tables** (`--redis-url`, several gateways): replicas publish their heartbeats, loads, KV
  block events and adapters themselves (`routing.ReplicaPublisher`); the gateway only reads and
  reserves. `observe_routing=False`.
- **In-process tables** (the embedded default): the gateway keeps the tables itself. It registers
  the control plane's ready replicas, and after routing a prompt to a replica it records the
  prompt's blocks there (that replica will hold them once it prefilled them), forgetting the
  least recently routed blocks beyond the replica's KV capacity: the approximate cache view of
  SGLang's cache-aware router, which needs nothing from the replicas.

With Redis, no call to it runs on the event loop once a model's first request was routed: choosing runs in a worker
thread, releases are handed to one, and the other gateways' replicas come from a list refreshed in the background.
A Redis that stops answering (hung, partitioned) costs one timeout: the tables are then left alone for
`OUTAGE_BACKOFF_S`, requests go to the least loaded replica the gateway knows, and the last list of other gateways'
replicas stays in use for `REMOTE_STALE_S` (a replica that died meanwhile is skipped by the proxy's retry).

Torch-free; a request the gateway cannot tokenize routes on load alone.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace
from typing import Any, NamedTuple

from ember_platform.control.deployments import Deployment, Replica
from ember_platform.routing import (
    ReplicaLoad,
    ReplicaRecord,
    ReplicaState,
    Reservation,
    Router,
    RoutingError,
    RoutingTables,
    TablesUnavailable,
)
from ember_platform.routing.prompts import PromptHasher

log = logging.getLogger("ember.gateway.routing")

LEASE_S = 30.0
REMOTE_REFRESH_S = 0.25  # how old the list of other gateways' replicas may be before a background refresh
REMOTE_STALE_S = 10.0  # how long that list stays in use while the tables cannot be read
OUTAGE_BACKOFF_S = 2.0  # after the tables failed to answer, leave them alone this long (routing by load meanwhile)
# Requests a replica is sent at once before the router prefers waiting elsewhere; engines queue beyond
# max_num_seqs themselves, so the embedded gateway does not cap it (the load scorer prices the queueing).
UNCAPPED = 1 << 20
# Routing tokenizes at most this many characters of a text prompt per token of context: enough for the blocks any
# replica could hold (a token is rarely longer), so a prompt far past the context costs no more than a full one.
ROUTING_CHARS_PER_TOKEN = 16
ROUTING_DEFAULT_CONTEXT = 131072  # tokens: the bound for a package that leaves max_model_len to its checkpoint


class KVAwareChooser:
    """A `ReplicaChooser` for the proxy: `achoose` reserves the best replica, `release` ends the reservation."""

    def __init__(self, router: Router, *, observe_routing: bool, policy: str = "kv",
                 blocks_per_replica: int = 8192, replica_secret: str | None = None) -> None:
        """`replica_secret`: the cluster secret other gateways' replicas require (replica/auth.py)."""
        if policy not in ("kv", "round-robin"):
            raise ValueError(f"routing policy must be 'kv' or 'round-robin', got {policy!r}")
        self.router = router
        self.policy = policy
        self.replica_secret = replica_secret
        self._turn = 0
        self._remote: dict[str, Replica] = {}  # replicas of other gateways' control planes, by id
        self.tables: RoutingTables = router.tables
        self.observe_routing = observe_routing
        self.blocks_per_replica = blocks_per_replica
        self._incarnation = uuid.uuid4().hex
        self._epoch: str | None = None
        self._predicted: dict[str, OrderedDict[bytes, None]] = {}  # replica id -> blocks routed there, LRU
        self._adapters: dict[str, OrderedDict[str, None]] = {}
        self._reservations: dict[str, Reservation] = {}  # request id -> its slot
        self._remote_views: dict[str, tuple[float, list[Any]]] = {}  # model -> (read at, its replicas' views)
        self._refreshing: set[str] = set()
        self._down_until = 0.0  # monotonic time before which the tables are not asked (an outage)
        self._lock = threading.Lock()
        self._io = ThreadPoolExecutor(2, thread_name_prefix="ember-routing-io")  # releases and refreshes
        self._hashing = ThreadPoolExecutor(2, thread_name_prefix="ember-routing-hash")  # tokenize + hash prompts

    # --- the proxy's interface -------------------------------------------------------------------

    async def achoose(self, deployment: Deployment, candidates: Sequence[Replica], body: bytes,
                      request_id: str) -> Replica:
        # Tokenizing and hashing cost CPU in proportion to the prompt: a worker thread does it, never the event loop
        # (a 4 MB prompt once held every request, /health included, for seconds).
        prompt = await asyncio.get_running_loop().run_in_executor(self._hashing, self._prompt_blocks, deployment,
                                                                  body)
        if self.observe_routing:  # in-process tables: the cheap choice and table update stay on the loop, their owner
            return self._choose(deployment, candidates, prompt, request_id)
        return await asyncio.to_thread(self._choose, deployment, candidates, prompt, request_id)

    def prefilled(self, request_id: str) -> None:
        """The request's first bytes came back: its prompt no longer counts as prefill pending on its replica
        (only where the `load` scorer prices pending prefill; otherwise there is nothing to undo)."""
        reservation = self._reservations.get(request_id)
        if reservation is not None and reservation.pending_work:
            self._off_loop(reservation.prefilled, "recording a prefill as done")

    def release(self, request_id: str) -> None:
        reservation = self._reservations.pop(request_id, None)
        if reservation is not None:
            # Even in an outage: a hold left behind would make its replica look busy until it lapses (minutes).
            self._off_loop(reservation.release, "releasing a routing reservation")

    def _off_loop(self, call: Callable[[], None], what: str) -> None:
        """In-process tables: now. Redis: in a worker thread, so that the event loop never waits on it."""
        def run() -> None:
            try:
                call()
            except RoutingError as e:
                self._outage(e)
                log.warning("%s failed: %s", what, e)

        if self.observe_routing:
            run()
        else:
            self._io.submit(run)

    # --- internals -------------------------------------------------------------------------------

    def remote_candidates(self, dep: Deployment) -> list[Replica]:
        """Ready replicas of the active version in shared tables that this gateway does not run itself.

        From a list read at most REMOTE_REFRESH_S ago, refreshed in the background; only a model's first request
        waits for a read."""
        if self.observe_routing:
            return []
        now = time.monotonic()
        cached = self._remote_views.get(dep.name)
        if cached is None:
            self._refresh_remote(dep.name)
            cached = self._remote_views.get(dep.name)
        elif now - cached[0] > REMOTE_REFRESH_S:
            with self._lock:
                start = dep.name not in self._refreshing and now >= self._down_until
                if start:
                    self._refreshing.add(dep.name)
            if start:
                self._io.submit(self._refresh_remote, dep.name)
        if cached is None or now - cached[0] > REMOTE_STALE_S:
            return []
        local = {r.id for r in dep.replicas}
        out = []
        for view in cached[1]:
            record = view.record
            if record.state != ReplicaState.READY or record.version != dep.active_version or view.replica_id in local:
                continue
            replica = self._remote.get(view.replica_id)
            if replica is None or replica.remote_url != record.url:
                replica = self._remote[view.replica_id] = Replica(version=record.version, id=view.replica_id,
                                                                  remote_url=record.url,
                                                                  remote_secret=self.replica_secret)
            out.append(replica)
        return out

    def _refresh_remote(self, model: str) -> None:
        try:
            if time.monotonic() >= self._down_until:
                self._remote_views[model] = (time.monotonic(), self.tables.snapshot(model))
        except RoutingError as e:
            self._outage(e)
        finally:
            with self._lock:
                self._refreshing.discard(model)
        live = {v.replica_id for _, views in self._remote_views.values() for v in views}
        for replica_id in [r for r in self._remote if r not in live]:  # forget replicas no table lists any more
            self._remote.pop(replica_id, None)

    def _outage(self, error: RoutingError) -> None:
        if time.monotonic() >= self._down_until:
            log.warning("routing tables unavailable (%s); routing on this gateway's own view for %.0f s", error,
                        OUTAGE_BACKOFF_S)
        self._down_until = time.monotonic() + OUTAGE_BACKOFF_S

    def _prompt_blocks(self, dep: Deployment, body: bytes) -> _PromptBlocks:
        """The request's prompt as routing sees it: block hashes of at most the model's context (the first
        `max_model_len * ROUTING_CHARS_PER_TOKEN` characters of a text prompt), its token count and adapter."""
        hasher = PromptHasher.for_package(dep.active.package_dir)
        # Without [runtime] max_model_len the engine takes the checkpoint's; routing needs no more than a bound.
        max_model_len = dep.active.manifest.runtime.max_model_len or ROUTING_DEFAULT_CONTEXT
        parsed, lora, truncated = _parse(body, max_chars=max_model_len * ROUTING_CHARS_PER_TOKEN)
        if self.policy != "kv" or parsed is None:
            return _PromptBlocks((), 0, lora, hasher.block_size)
        ids = hasher.request_ids(parsed) or []
        if truncated:  # tokens near the cut may differ from the whole prompt's: keep only full blocks well before it
            ids = ids[:max(0, (min(len(ids), max_model_len) // hasher.block_size - 1) * hasher.block_size)]
        hashes = hasher.block_hashes(ids, lora=lora, salt=getattr(parsed, "cache_salt", None)) if ids else ()
        return _PromptBlocks(hashes, len(ids), lora, hasher.block_size)

    def _choose(self, dep: Deployment, candidates: Sequence[Replica], prompt: _PromptBlocks,
                request_id: str) -> Replica:
        by_id = {r.id: r for r in candidates}
        hashes, lora = prompt.hashes, prompt.lora
        if self.observe_routing:
            self._register(dep, candidates, prompt.block_size)
        allowed = set(by_id)
        if self.policy == "round-robin":  # the baseline: every replica in turn, whatever it holds
            self._turn += 1
            allowed = {sorted(by_id)[self._turn % len(by_id)]}
        if not self.observe_routing and time.monotonic() < self._down_until:
            return min(candidates, key=lambda r: r.in_flight)  # an outage: don't wait on the tables again yet
        try:
            reservation = self.router.choose(dep.name, hashes, lora, num_prompt_tokens=prompt.num_tokens,
                                             allowed=allowed, hold_s=dep.request_timeout + 60)
        except RoutingError as e:  # tables unreachable or nothing ready in them: the control plane's view decides
            if isinstance(e, TablesUnavailable):
                self._outage(e)
            log.info("%s: routing tables cannot choose (%s); taking the least loaded replica", dep.name, e)
            return min(candidates, key=lambda r: r.in_flight)
        self._reservations[request_id] = reservation
        replica = by_id[reservation.replica_id]
        self._record(replica.id, hashes, lora)
        return replica

    def _register(self, dep: Deployment, candidates: Sequence[Replica], block_size: int) -> None:
        max_num_seqs = dep.active.manifest.runtime.max_num_seqs
        for replica in candidates:
            if replica.url is None:
                continue
            record = ReplicaRecord(replica.id, dep.name, replica.url, version=replica.version,
                                   state=ReplicaState.READY, block_size=block_size,
                                   load=ReplicaLoad(max_num_seqs=max_num_seqs, capacity=UNCAPPED),
                                   adapters=frozenset(self._adapters.get(replica.id, ())))
            result = self.tables.heartbeat(record, incarnation=self._incarnation, epoch=self._epoch, ttl_s=LEASE_S)
            self._epoch = result.epoch
            if result.resync:
                self.tables.replace_blocks(replica.id, list(self._predicted.get(replica.id, ())), ttl_s=LEASE_S)

    def _record(self, replica_id: str, hashes: Sequence[bytes], lora: str | None) -> None:
        """The replica will hold these blocks once it prefilled them: say so now, so that the next request with
        this prefix (from any gateway) follows it there instead of waiting for the replica's own events (as
        Dynamo's router counts the blocks of the requests it has routed). With shared tables the replica's events
        then confirm or evict them; in-process, the least recently routed blocks beyond its capacity are dropped."""
        if not hashes:
            return
        if not self.observe_routing:
            try:
                self.tables.update_blocks(replica_id, hashes, (), ttl_s=LEASE_S)
            except RoutingError as e:
                log.debug("could not record predicted blocks: %s", e)
            return
        lru = self._predicted.setdefault(replica_id, OrderedDict())
        for h in hashes:
            lru[h] = None
            lru.move_to_end(h)
        evicted = [lru.popitem(last=False)[0] for _ in range(max(0, len(lru) - self.blocks_per_replica))]
        self.tables.update_blocks(replica_id, hashes, evicted, ttl_s=LEASE_S)
        if lora:
            adapters = self._adapters.setdefault(replica_id, OrderedDict())
            adapters[lora] = None
            adapters.move_to_end(lora)


class _PromptBlocks(NamedTuple):
    hashes: tuple[bytes, ...]
    num_tokens: int
    lora: str | None
    block_size: int


def _parse(body: bytes, *, max_chars: int) -> tuple[Any | None, str | None, bool]:
    """The request as the prompt hasher reads it (chat messages or completion prompts), its adapter, and whether
    its text was cut to `max_chars` (a chat longer than that routes on load alone)."""
    try:
        data = json.loads(body)
    except (ValueError, RecursionError):
        return None, None, False
    if not isinstance(data, dict):
        return None, None, False
    model = data.get("model")
    lora = model.split(":", 1)[1] if isinstance(model, str) and ":" in model else None
    salt = data.get("cache_salt") if isinstance(data.get("cache_salt"), str) else None
    if isinstance(data.get("messages"), list):
        messages, tools = data["messages"], data.get("tools")
        if sum(len(m["content"]) for m in messages if isinstance(m, dict) and isinstance(m.get("content"), str)) > \
                max_chars:
            return None, lora, False
        return SimpleNamespace(template_messages=lambda: messages, template_tools=lambda: tools,
                               cache_salt=salt), lora, False
    prompt = data.get("prompt")
    if isinstance(prompt, str) or (isinstance(prompt, list) and prompt):
        prompts = [prompt] if isinstance(prompt, str) or isinstance(prompt[0], int) else prompt
        first = prompts[0]
        truncated = isinstance(first, str) and len(first) > max_chars
        if truncated:
            prompts = [first[:max_chars]]
        return SimpleNamespace(prompts=lambda: prompts, cache_salt=salt), lora, truncated
    return None, lora, False
