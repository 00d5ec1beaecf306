"""The S3 tier (boto3, any endpoint: AWS, MinIO, R2, moto), shared by every replica of a model.

It sits on the request path — a request whose prefix is in S3 waits for the GETs — so a slow or dead
endpoint must cost little: one attempt per request with short timeouts, and a circuit breaker that, after a
few consecutive failures, skips S3 altogether for a cool-down before letting one probe through. Every failure
reads as a miss to the caller: the request recomputes, and a counter says so.
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ember_platform.engine.block_hash import BlockHash
from ember_platform.kvtiers.format import KVLayout
from ember_platform.kvtiers.tiers import BLOCK_SUFFIX, OnChange

log = logging.getLogger("ember.kvtiers")

_NOT_FOUND = frozenset({"404", "NoSuchKey", "NotFound"})


class S3Unavailable(RuntimeError):
    """The S3 tier could not answer (an error, a timeout, or the circuit breaker is open)."""


class CircuitBreaker:
    """Closed: calls go through. `failures` consecutive failures open it: calls are refused for `cooldown_s`;
    then one probe goes through (half-open) — a success closes it, a failure opens it again."""

    def __init__(self, failures: int = 3, cooldown_s: float = 30.0, clock: Callable[[], float] = time.monotonic) \
            -> None:
        self.failures = failures
        self.cooldown_s = cooldown_s
        self._clock = clock
        self._consecutive = 0
        self._opened_at: float | None = None
        self._probing = False
        self._lock = threading.Lock()
        self.num_opened = 0

    @property
    def state(self) -> str:
        with self._lock:
            if self._opened_at is None:
                return "closed"
            return "half-open" if self._probing or self._clock() - self._opened_at >= self.cooldown_s else "open"

    def allow(self) -> bool:
        with self._lock:
            if self._opened_at is None:
                return True
            if self._probing or self._clock() - self._opened_at < self.cooldown_s:
                return False
            self._probing = True  # this caller is the probe; everyone else waits for its verdict
            return True

    def success(self) -> None:
        with self._lock:
            if self._opened_at is not None:
                log.info("S3 tier reachable again: circuit breaker closed")
            self._consecutive = 0
            self._opened_at = None
            self._probing = False

    def failure(self) -> None:
        with self._lock:
            self._consecutive += 1
            if self._probing or (self._opened_at is None and self._consecutive >= self.failures):
                if self._opened_at is None:
                    self.num_opened += 1
                self._opened_at = self._clock()
                self._probing = False


class S3Tier:
    """Blocks as objects `<prefix>/<layout namespace>/<hash hex>.kvb`; small JSON documents beside them.

    Capacity: with `capacity_bytes`, this replica deletes its own least recently used uploads beyond it; the
    bucket as a whole is best bounded by a lifecycle rule (expire after N days), since replicas share it.
    """

    name = "s3"

    def __init__(self, url: str, layout: KVLayout, *, endpoint_url: str | None = None, timeout_s: float = 1.0,
                 breaker: CircuitBreaker | None = None, fetch_threads: int = 8, capacity_bytes: int | None = None,
                 on_change: OnChange | None = None) -> None:
        import boto3  # takes a while to import: only when the tier is configured
        from botocore.config import Config

        bucket, _, prefix = url.removeprefix("s3://").partition("/")
        self.bucket = bucket
        self.prefix = f"{prefix.strip('/')}/{layout.namespace}/" if prefix.strip("/") else f"{layout.namespace}/"
        self.url = url
        # Names the store in the routing tables: replicas that agree on it read each other's uploads.
        self.store_id = f"{endpoint_url or 'aws'}|{bucket}/{self.prefix}"
        self.breaker = breaker or CircuitBreaker()
        self.capacity_bytes = capacity_bytes
        config = Config(connect_timeout=timeout_s, read_timeout=timeout_s,
                        retries={"mode": "standard", "total_max_attempts": 1},
                        max_pool_connections=fetch_threads + 4,
                        s3={"addressing_style": "path"} if endpoint_url else None)
        self._client: Any = boto3.session.Session().client("s3", endpoint_url=endpoint_url, config=config)
        self._pool = ThreadPoolExecutor(fetch_threads, thread_name_prefix="ember-kv-s3-get")
        self._uploads: OrderedDict[BlockHash, int] = OrderedDict()  # this replica's own, for capacity_bytes
        self._upload_bytes = 0
        self._lock = threading.Lock()
        self._on_change = on_change
        self.num_errors = 0
        self.num_skipped = 0  # calls not made: the breaker was open

    def key(self, block_hash: BlockHash) -> str:
        return f"{self.prefix}{block_hash.hex()}{BLOCK_SUFFIX}"

    # --- reads (the request path) -------------------------------------------------------------------

    def get(self, block_hash: BlockHash) -> bytearray | None:
        """The stored block, or None if there is none; raises S3Unavailable when S3 cannot say."""
        body = self._call(lambda: self._get_object(self.key(block_hash)))
        if body is not None:
            with self._lock:
                if block_hash in self._uploads:
                    self._uploads.move_to_end(block_hash)
        return body

    def get_run(self, block_hashes: Sequence[BlockHash]) -> list[bytearray]:
        """The stored blocks of the longest leading run of `block_hashes` that S3 holds.

        The first block alone (a miss costs one round trip), then the rest in parallel. Raises S3Unavailable
        only when not even the first could be read; later failures just end the run.
        """
        if not block_hashes:
            return []
        first = self.get(block_hashes[0])
        if first is None:
            return []
        out = [first]
        futures = [self._pool.submit(self.get, h) for h in block_hashes[1:]]
        for future in futures:
            try:
                body = future.result()
            except S3Unavailable:
                body = None
            if body is None:
                break
            out.append(body)
        for future in futures:
            future.cancel()
        return out

    def _get_object(self, key: str) -> bytearray | None:
        from botocore.exceptions import ClientError

        try:
            response = self._client.get_object(Bucket=self.bucket, Key=key)
        except ClientError as e:
            if str(e.response.get("Error", {}).get("Code", "")) in _NOT_FOUND:
                return None
            raise
        return bytearray(response["Body"].read())

    # --- writes (the writer thread) -------------------------------------------------------------------

    def put(self, block_hash: BlockHash, data: bytes) -> None:
        self._call(lambda: self._client.put_object(Bucket=self.bucket, Key=self.key(block_hash), Body=data))
        evicted: list[BlockHash] = []
        with self._lock:
            self._upload_bytes += len(data) - self._uploads.pop(block_hash, 0)
            self._uploads[block_hash] = len(data)
            while self.capacity_bytes is not None and self._upload_bytes > self.capacity_bytes and self._uploads:
                old, size = self._uploads.popitem(last=False)
                self._upload_bytes -= size
                evicted.append(old)
        for old in evicted:
            with contextlib.suppress(S3Unavailable):  # else left to the bucket's lifecycle rule
                self._call(lambda old=old: self._client.delete_object(Bucket=self.bucket, Key=self.key(old)))
        if self._on_change is not None:
            self._on_change(self.name, [] if block_hash in evicted else [block_hash],
                            [h for h in evicted if h != block_hash])

    def put_json(self, name: str, doc: Any) -> None:
        body = json.dumps(doc, separators=(",", ":")).encode()
        self._call(lambda: self._client.put_object(Bucket=self.bucket, Key=self.prefix + name, Body=body,
                                                   ContentType="application/json"))

    def read_json_under(self, folder: str) -> list[Any]:
        """Every JSON document under `<namespace>/<folder>/` (unreadable ones skipped)."""
        def list_and_read() -> list[Any]:
            docs = []
            paginator = self._client.get_paginator("list_objects_v2")
            for page in paginator.paginate(Bucket=self.bucket, Prefix=f"{self.prefix}{folder}/"):
                for obj in page.get("Contents", []):
                    body = self._get_object(obj["Key"])
                    try:
                        docs.append(json.loads(bytes(body or b"null")))
                    except ValueError:
                        continue
            return docs

        return self._call(list_and_read)

    def hashes(self) -> list[BlockHash]:
        """The blocks this replica uploaded (what it can vouch for; others' uploads are theirs to publish)."""
        with self._lock:
            return list(self._uploads)

    # --- every call ---------------------------------------------------------------------------------

    def _call(self, fn: Callable[[], Any]) -> Any:
        from botocore.exceptions import BotoCoreError, ClientError

        if not self.breaker.allow():
            self.num_skipped += 1
            raise S3Unavailable(f"{self.url}: skipped while the circuit breaker is open")
        try:
            result = fn()
        except (BotoCoreError, ClientError, OSError) as e:
            self.num_errors += 1
            self.breaker.failure()
            raise S3Unavailable(f"{self.url}: {e}") from None
        self.breaker.success()
        return result

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
