"""Routing tables in Redis (plain Redis 7, no modules), shared by every gateway and replica that points at it.

Keys, under a namespace (default "ember:rt:"):

    epoch                  string  the tables' generation: gone after a restart without persistence, so the
                                   next heartbeat creates a new one and every publisher resyncs
    m:MODEL:leases         zset    replica id -> lease deadline (server time, ms)
    r:ID                   hash    the replica's record: model, url, state, load, adapters, incarnation
    r:ID:blocks            hash    its KV block hashes (16 raw bytes each) -> tier rank (0 device, 1 CPU, 2 disk)
    s:STORE                set     the block hashes in a shared store (S3) that replicas name in `shared_store`
    r:ID:held              zset    reservation token -> deadline: the in-flight count is its size
    r:ID:work              hash    reservation token -> its prompt tokens not yet prefilled (until its first token)
    deployments            hash    model -> deployment state

Everything that must be consistent runs as one Lua script: the heartbeat, the snapshot (which also reaps
lapsed replicas) and the reservation, which re-reads the loads it decides on, so two gateways never both take a
replica's last free slot. Times come from the server's clock (TIME), so gateways' clocks do not matter. A
replica's keys expire with its lease too, so a store nobody reads does not fill up with the dead.
"""

from __future__ import annotations

import contextlib
import json
import logging
import uuid
from collections.abc import Collection, Iterator, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from ember_platform.routing.records import (
    SHARED,
    Balance,
    Candidate,
    DeploymentState,
    HeartbeatResult,
    KVFetchCosts,
    NoReadyReplica,
    ReplicaLoad,
    ReplicaRecord,
    ReplicasBusy,
    ReplicaState,
    ReplicaView,
    Reservation,
    TablesUnavailable,
)
from ember_platform.routing.tables import (
    DEFAULT_HOLD_S,
    SHARED_TTL_S,
    BlockTiers,
    RoutingTables,
    as_tiers,
)

if TYPE_CHECKING:
    import redis

log = logging.getLogger("ember.routing")

T = TypeVar("T")
DEFAULT_NAMESPACE = "ember:rt:"
_CHUNK = 4000  # members per SADD/SREM/SMISMEMBER: below Lua's unpack() limit, and no giant commands

_NOW = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
"""

# ARGV: ns, model, id, incarnation, known epoch ('' for none), ttl ms, fresh epoch, then record field/value pairs.
_HEARTBEAT = _NOW + """
local ns, model, id, inc, known, ttl, fresh = ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5], tonumber(ARGV[6]), ARGV[7]
local epoch = redis.call('GET', ns .. 'epoch')
if not epoch then
  epoch = fresh
  redis.call('SET', ns .. 'epoch', epoch)
end
local rkey = ns .. 'r:' .. id
local resync = 0
if epoch ~= known or redis.call('HGET', rkey, 'incarnation') ~= inc then
  resync = 1
  -- whatever is stored for this id is stale (another incarnation, or events applied after a lapse)
  redis.call('DEL', rkey, rkey .. ':blocks')
end
redis.call('HSET', rkey, 'incarnation', inc, 'model', model, unpack(ARGV, 8))
redis.call('PEXPIRE', rkey, ttl)
redis.call('PEXPIRE', rkey .. ':blocks', ttl)
redis.call('ZADD', ns .. 'm:' .. model .. ':leases', now + ttl, id)
return {epoch, resync}
"""

# ARGV: ns, model, then the request's block hashes. Returns {id, in_flight, tier ranks, {hash fields}} per live
# replica, the ranks as a string of digits, one per block of the leading run it can reuse (tables.leading_tiers is
# the reference); reaps the lapsed replicas on the way.
_SNAPSHOT = _NOW + """
local ns, model = ARGV[1], ARGV[2]
local lkey = ns .. 'm:' .. model .. ':leases'
local dead = redis.call('ZRANGEBYSCORE', lkey, '-inf', now)
for _, id in ipairs(dead) do
  local rkey = ns .. 'r:' .. id
  redis.call('DEL', rkey, rkey .. ':blocks', rkey .. ':held', rkey .. ':work')
end
if #dead > 0 then redis.call('ZREMRANGEBYSCORE', lkey, '-inf', now) end

local function members(key)  -- 1/0 per request hash: is it in the set at key?
  local out, i = {}, 3
  while i <= #ARGV do
    local j = math.min(i + CHUNK - 1, #ARGV)
    for _, hit in ipairs(redis.call('SMISMEMBER', key, unpack(ARGV, i, j))) do out[#out + 1] = hit end
    i = j + 1
  end
  return out
end

local shared_cache = {}
local function leading_tiers(key, store)
  local shared = nil
  if store and store ~= '' then
    shared = shared_cache[store]
    if shared == nil then
      shared = members(ns .. 's:' .. store)
      shared_cache[store] = shared
    end
  end
  local ranks, i = {}, 3
  while i <= #ARGV do
    local j = math.min(i + CHUNK - 1, #ARGV)
    local own = redis.call('HMGET', key, unpack(ARGV, i, j))
    for k = 1, #own do
      local rank = own[k]
      if not rank then
        if shared and shared[i - 3 + k] == 1 then rank = 'SHARED' else return table.concat(ranks) end
      end
      ranks[#ranks + 1] = rank  -- hashes chain: only the leading run is reusable
    end
    i = j + 1
  end
  return table.concat(ranks)
end

local out = {}
for _, id in ipairs(redis.call('ZRANGEBYSCORE', lkey, '(' .. now, '+inf')) do
  local rkey = ns .. 'r:' .. id
  local fields = redis.call('HGETALL', rkey)
  if #fields > 0 then
    local store = redis.call('HGET', rkey, 'shared_store')
    redis.call('ZREMRANGEBYSCORE', rkey .. ':held', '-inf', now)
    out[#out + 1] = {id, redis.call('ZCARD', rkey .. ':held'), leading_tiers(rkey .. ':blocks', store), fields}
  end
end
return out
""".replace("CHUNK", str(_CHUNK)).replace("SHARED", str(SHARED))

# ARGV: ns, model, token, hold ms, abs threshold, rel threshold, then (id, cost, per_request, per_queued,
# per_pending, work) per candidate. The same rule as tables.pick(), which is its reference. Returns
# {'ok', id, in_flight, cost, url, work}, {'none'} or {'busy'}.
_RESERVE = _NOW + """
local ns, model, token = ARGV[1], ARGV[2], ARGV[3]
local hold, abs, rel = tonumber(ARGV[4]), tonumber(ARGV[5]), tonumber(ARGV[6])
local lkey = ns .. 'm:' .. model .. ':leases'
local rows, least = {}, nil
for i = 7, #ARGV, 6 do
  local id = ARGV[i]
  local deadline = redis.call('ZSCORE', lkey, id)
  local rkey = ns .. 'r:' .. id
  if deadline and tonumber(deadline) > now then
    local f = redis.call('HMGET', rkey, 'state', 'capacity', 'max_num_seqs', 'url')
    if f[1] == 'ready' then
      local held, work = rkey .. ':held', rkey .. ':work'
      local mine = redis.call('ZSCORE', held, token)
      if mine then
        -- a retry of a call whose reply was lost: it already holds a slot here
        return {'ok', id, redis.call('ZCARD', held), '0', f[4], '0'}
      end
      local lapsed = redis.call('ZRANGEBYSCORE', held, '-inf', now)
      if #lapsed > 0 then
        redis.call('ZREMRANGEBYSCORE', held, '-inf', now)
        redis.call('HDEL', work, unpack(lapsed))
      end
      local pending = 0
      for _, w in ipairs(redis.call('HVALS', work)) do pending = pending + tonumber(w) end
      local load = redis.call('ZCARD', held)
      rows[#rows + 1] = {id = id, url = f[4], held = held, work = work, load = load, cap = tonumber(f[2]),
                         seqs = tonumber(f[3]), cost = tonumber(ARGV[i + 1]), pr = tonumber(ARGV[i + 2]),
                         pq = tonumber(ARGV[i + 3]), pp = tonumber(ARGV[i + 4]), mywork = tonumber(ARGV[i + 5]),
                         pending = pending}
      if least == nil or load < least then least = load end
    end
  end
end
if #rows == 0 then return {'none'} end
local best, best_cost = nil, 0
for _, r in ipairs(rows) do
  if r.load < r.cap and not (r.load - least > abs and r.load > rel * least) then
    local cost = r.cost + r.pr * r.load + r.pq * math.max(0, r.load + 1 - r.seqs) + r.pp * r.pending
    if best == nil or cost < best_cost or (cost == best_cost and r.load < best.load) then
      best, best_cost = r, cost
    end
  end
end
if best == nil then return {'busy'} end
redis.call('ZADD', best.held, now + hold, token)
if redis.call('PTTL', best.held) < hold then redis.call('PEXPIRE', best.held, hold) end
if best.mywork > 0 then
  redis.call('HSET', best.work, token, string.format('%.17g', best.mywork))
  if redis.call('PTTL', best.work) < hold then redis.call('PEXPIRE', best.work, hold) end
end
return {'ok', best.id, best.load + 1, string.format('%.17g', best_cost), best.url,
        string.format('%.17g', best.mywork)}
"""


class RedisTables(RoutingTables):
    def __init__(self, client: redis.Redis, *, namespace: str = DEFAULT_NAMESPACE, where: str = "Redis") -> None:
        self.client = client
        self.ns = namespace
        self.where = where
        self._heartbeat = client.register_script(_HEARTBEAT)
        self._snapshot = client.register_script(_SNAPSHOT)
        self._reserve = client.register_script(_RESERVE)

    @classmethod
    def from_url(cls, url: str, *, namespace: str = DEFAULT_NAMESPACE, timeout_s: float = 2.0) -> RedisTables:
        """A client that reconnects on its own: after a Redis restart the next command retries on a new
        connection (and redis-py reloads the scripts the restart forgot)."""
        import redis
        from redis.backoff import ExponentialBackoff
        from redis.retry import Retry

        client = redis.Redis.from_url(
            url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
            retry=Retry(ExponentialBackoff(cap=0.5, base=0.02), retries=3),
            retry_on_error=[redis.ConnectionError, redis.TimeoutError])
        return cls(client, namespace=namespace, where=url)

    # --- the replica's side ---------------------------------------------------------------------

    def heartbeat(self, record: ReplicaRecord, *, incarnation: str, epoch: str | None,
                  ttl_s: float) -> HeartbeatResult:
        load = record.load
        fields: list[Any] = [
            "url", record.url, "version", record.version, "state", str(record.state),
            "block_size", record.block_size, "running", load.num_running, "waiting", load.num_waiting,
            "free_blocks", load.num_free_blocks, "total_blocks", load.num_total_blocks,
            "max_num_seqs", load.max_num_seqs, "capacity", load.capacity,
            "adapters", json.dumps(sorted(record.adapters)), "kv_costs", record.kv_costs.to_json(),
            "shared_store", record.shared_store,
        ]
        with self._errors():
            new_epoch, resync = self._heartbeat(args=[self.ns, record.model, record.replica_id, incarnation,
                                                      epoch or "", _ms(ttl_s), uuid.uuid4().hex, *fields])
        return HeartbeatResult(new_epoch.decode(), bool(resync))

    def update_blocks(self, replica_id: str, stored: BlockTiers, removed: Collection[bytes], *,
                      ttl_s: float) -> None:
        key = self._key(replica_id, "blocks")
        with self._errors():
            pipe = self.client.pipeline(transaction=True)
            for chunk in _chunks(as_tiers(stored).items()):
                pipe.hset(key, mapping=dict(chunk))
            for chunk in _chunks(removed):
                pipe.hdel(key, *chunk)
            pipe.pexpire(key, _ms(ttl_s))  # events that outrun a lapsed lease must not leave a set forever
            pipe.execute()

    def replace_blocks(self, replica_id: str, hashes: BlockTiers, *, ttl_s: float) -> None:
        key = self._key(replica_id, "blocks")
        with self._errors():
            pipe = self.client.pipeline(transaction=True)  # readers see the old set or the new one, never half
            pipe.delete(key)
            for chunk in _chunks(as_tiers(hashes).items()):
                pipe.hset(key, mapping=dict(chunk))
            pipe.pexpire(key, _ms(ttl_s))
            pipe.execute()

    def update_shared(self, store: str, stored: Collection[bytes], removed: Collection[bytes]) -> None:
        key = f"{self.ns}s:{store}"
        with self._errors():
            pipe = self.client.pipeline(transaction=True)
            for chunk in _chunks(stored):
                pipe.sadd(key, *chunk)
            for chunk in _chunks(removed):
                pipe.srem(key, *chunk)
            pipe.pexpire(key, _ms(SHARED_TTL_S))
            pipe.execute()

    def remove_replica(self, model: str, replica_id: str) -> None:
        with self._errors():
            pipe = self.client.pipeline(transaction=True)
            pipe.zrem(f"{self.ns}m:{model}:leases", replica_id)
            pipe.delete(self._key(replica_id), self._key(replica_id, "blocks"), self._key(replica_id, "held"),
                        self._key(replica_id, "work"))
            pipe.execute()

    # --- deployments ----------------------------------------------------------------------------

    def set_deployment_state(self, model: str, state: DeploymentState) -> None:
        with self._errors():
            self.client.hset(f"{self.ns}deployments", model, str(DeploymentState(state)))

    def stored_deployment_state(self, model: str) -> DeploymentState | None:
        with self._errors():
            value = self.client.hget(f"{self.ns}deployments", model)
        return DeploymentState(value.decode()) if value is not None else None

    # --- the gateway's side ---------------------------------------------------------------------

    def snapshot(self, model: str, block_hashes: Sequence[bytes] = ()) -> list[ReplicaView]:
        with self._errors():
            rows = self._snapshot(args=[self.ns, model, *block_hashes])
        views = []
        for replica_id, in_flight, ranks, fields in rows:
            tiers = tuple(int(r) for r in ranks.decode())
            views.append(ReplicaView(_record(model, replica_id.decode(), fields), int(in_flight), len(tiers), tiers))
        return sorted(views, key=lambda v: v.replica_id)

    def reserve(self, model: str, candidates: Sequence[Candidate], *, balance: Balance,
                hold_s: float = DEFAULT_HOLD_S, token: str | None = None) -> Reservation:
        token = token or uuid.uuid4().hex
        args: list[Any] = [self.ns, model, token, _ms(hold_s), balance.abs_threshold, repr(balance.rel_threshold)]
        for c in candidates:
            args += [c.replica_id, repr(float(c.cost)), repr(float(c.per_request)), repr(float(c.per_queued)),
                     repr(float(c.per_pending)), repr(float(c.work))]
        with self._errors():
            reply = self._reserve(args=args)
        status = reply[0].decode()
        if status == "none":
            raise NoReadyReplica(f"no ready replica of '{model}' in the routing tables at {self.where}")
        if status == "busy":
            raise ReplicasBusy(f"every ready replica of '{model}' is at capacity")
        return Reservation(model, reply[1].decode(), reply[4].decode(), token, int(reply[2]), float(reply[3]), 0,
                           float(reply[5]), _release=self._release, _prefilled=self._prefilled)

    def _prefilled(self, reservation: Reservation) -> None:
        try:
            with self._errors():
                self.client.hdel(self._key(reservation.replica_id, "work"), reservation.token)
        except TablesUnavailable as e:  # best effort: the entry goes with the reservation's release or deadline
            log.warning("reservation %s on replica %s: prefill not recorded as done (%s)", reservation.token,
                        reservation.replica_id, e)

    def _release(self, reservation: Reservation) -> None:
        try:
            with self._errors():
                pipe = self.client.pipeline(transaction=True)
                pipe.zrem(self._key(reservation.replica_id, "held"), reservation.token)
                pipe.hdel(self._key(reservation.replica_id, "work"), reservation.token)
                pipe.execute()
        except TablesUnavailable as e:
            # Best effort by design: the request is over either way, and the slot frees itself at its deadline.
            log.warning("reservation %s on replica %s not released (%s); it lapses on its own",
                        reservation.token, reservation.replica_id, e)

    def block_tiers(self, replica_id: str) -> dict[bytes, int]:
        with self._errors():
            return {h: int(r) for h, r in self.client.hgetall(self._key(replica_id, "blocks")).items()}

    def shared_blocks(self, store: str) -> set[bytes]:
        with self._errors():
            return set(self.client.smembers(f"{self.ns}s:{store}"))

    def close(self) -> None:
        self.client.close()

    # --- internals ------------------------------------------------------------------------------

    def _key(self, replica_id: str, part: str = "") -> str:
        return f"{self.ns}r:{replica_id}" + (f":{part}" if part else "")

    @contextlib.contextmanager
    def _errors(self) -> Iterator[None]:
        import redis

        try:
            yield
        except (redis.ConnectionError, redis.TimeoutError) as e:
            raise TablesUnavailable(f"the routing tables at {self.where} cannot be reached: {e}") from e


def _record(model: str, replica_id: str, flat: list[bytes]) -> ReplicaRecord:
    f = {flat[i].decode(): flat[i + 1].decode() for i in range(0, len(flat), 2)}
    load = ReplicaLoad(num_running=int(f["running"]), num_waiting=int(f["waiting"]),
                       num_free_blocks=int(f["free_blocks"]), num_total_blocks=int(f["total_blocks"]),
                       max_num_seqs=int(f["max_num_seqs"]), capacity=int(f["capacity"]))
    return ReplicaRecord(replica_id, model, f["url"], version=f["version"], state=ReplicaState(f["state"]),
                         block_size=int(f["block_size"]), load=load, adapters=frozenset(json.loads(f["adapters"])),
                         kv_costs=KVFetchCosts.from_json(f.get("kv_costs", "")), shared_store=f.get("shared_store", ""))


def _chunks(items: Collection[T]) -> Iterator[list[T]]:
    batch = list(items)
    for i in range(0, len(batch), _CHUNK):
        yield batch[i:i + _CHUNK]


def _ms(seconds: float) -> int:
    return max(1, round(seconds * 1000))
