"""The gateway's HTTP transport to its replicas: httpx's own, with connection-pool bookkeeping linear in the pool.

httpcore's `AsyncConnectionPool` (1.0.x) re-plans the whole pool whenever a request starts or a response closes, and
that plan is quadratic in the pooled connections: for every connection it counts all of them again (a list built per
connection). The gateway keeps a connection per stream in flight, plus idle ones, so with 32 streams and 64 pooled
connections every request start and end cost ~4,000 calls: in bench/bench_gateway.py this bookkeeping was a third of
the gateway's CPU, and it sits on each request's way to its replica. `LinearConnectionPool` makes the same decisions
(the same closing, reuse and creation rules, in the same order) in one pass over the pool.

It replaces only that method, on a pool httpx built with its own settings; with an httpcore whose pool is not the one
this was written against (another major version), the stock pool is kept.
"""

from __future__ import annotations

from typing import Any

import httpcore
import httpx

_SUPPORTED = httpcore.__version__.startswith("1.") and hasattr(httpcore.AsyncConnectionPool,
                                                                "_assign_requests_to_connections")


class LinearConnectionPool(httpcore.AsyncConnectionPool):
    """httpcore's pool, its request-to-connection assignment done in time linear in the connections."""

    def _assign_requests_to_connections(self) -> list[Any]:
        # As httpcore 1.0's: drop closed connections; close expired ones, and idle ones while the pool holds more
        # connections than it may keep alive (httpcore compares the count of all connections, not idle ones: kept).
        closing: list[Any] = []
        connections = self._connections
        for connection in list(connections):
            if connection.is_closed():
                connections.remove(connection)
            elif connection.has_expired() or (connection.is_idle()
                                              and len(connections) > self._max_keepalive_connections):
                connections.remove(connection)
                closing.append(connection)
        # Then each queued request, oldest first: the first available connection to its origin; else a new one if
        # the pool has room; else a new one in place of the first idle connection; else it stays queued.
        for pool_request in [request for request in self._requests if request.is_queued()]:
            origin = pool_request.request.url.origin
            connection = next((c for c in connections if c.can_handle_request(origin) and c.is_available()), None)
            if connection is None:
                if len(connections) >= self._max_connections:
                    idle = next((c for c in connections if c.is_idle()), None)
                    if idle is None:
                        continue
                    connections.remove(idle)
                    closing.append(idle)
                connection = self.create_connection(origin)
                connections.append(connection)
            pool_request.assign_to_connection(connection)
        return closing


def upstream_transport(limits: httpx.Limits) -> httpx.AsyncHTTPTransport:
    """httpx's HTTP/1.1 transport with these limits, its pool's bookkeeping linear (see the module docstring)."""
    transport = httpx.AsyncHTTPTransport(limits=limits)
    pool = getattr(transport, "_pool", None)
    if _SUPPORTED and type(pool) is httpcore.AsyncConnectionPool:
        pool.__class__ = LinearConnectionPool  # the same object and settings; only the one method differs
    return transport
