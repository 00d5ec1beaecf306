"""Autoscaling: each supervision round, follow demand within the deployment's [scaling] (the rule is in
autoscaler.py), and put idle replicas of a scale-to-zero deployment to sleep before they stop."""

from __future__ import annotations

import asyncio
import logging
import time

import httpx

from ember_platform.control.autoscaler import ScaleMemory, ScalingPolicy, decide
from ember_platform.control.core import PlaneCore, retrieve
from ember_platform.control.deployments import Deployment, Replica, ReplicaState
from ember_platform.replica.auth import auth_headers

logger = logging.getLogger("ember.control")


class Autoscaling(PlaneCore):
    """Scale up at once, down after the idle delay, to zero through sleep."""

    def _autoscale(self, dep: Deployment) -> None:
        """Follow demand within [scaling]: start replicas at once, drain surplus ones after the idle delay; a
        deployment that scales to zero sleeps first (KV cache freed, weights kept) and stops after another delay."""
        scaling = dep.scaling()
        if dep.sleeping_since is not None:
            if dep.demand() == 0 and time.monotonic() - dep.sleeping_since >= scaling.scale_down_delay:
                for replica in dep.sleeping_replicas():
                    self._retire(dep, replica)
                dep.sleeping_since = None
                dep.log("autoscaler: asleep for the idle delay; scaled to zero")
                dep.notify()
            return
        policy = ScalingPolicy(scaling.min_replicas, scaling.max_replicas, scaling.target_concurrency,
                               scaling.scale_down_delay)
        memory = self._scale_memory.setdefault(dep.name, ScaleMemory())
        demand = dep.demand()
        desired = decide(policy, dep.desired, demand, time.monotonic(), memory)
        if desired == dep.desired:
            return
        if desired > dep.desired:
            dep.log(f"autoscaler: {demand} request(s) open or waiting; scaling up to {desired} replica(s)")
        elif desired == 0 and demand == 0 and all(r.state is ReplicaState.READY for r in dep.live_replicas()):
            # Idle and allowed to reach zero: sleep first, so a request in the next while wakes in a moment.
            for replica in dep.live_replicas():
                self._sleep(dep, replica)
            dep.sleeping_since = time.monotonic()
            dep.log(f"autoscaler: idle for {scaling.scale_down_delay:.0f} s; replicas sleep (KV cache freed)")
        else:
            # Surplus replicas drain (they finish what they hold); the least busy go first.
            live = sorted(dep.live_replicas(), key=lambda r: (r.in_flight, r.state is ReplicaState.READY))
            for replica in live[:max(0, len(live) - desired)]:
                self._retire(dep, replica)
            dep.log(f"autoscaler: {demand} request(s) for {scaling.scale_down_delay:.0f} s; scaling down to "
                    f"{desired} replica(s)" + (" (scaled to zero)" if desired == 0 else ""))
        dep.desired = desired
        dep.notify()

    def _sleep(self, dep: Deployment, replica: Replica) -> None:
        replica.state = ReplicaState.SLEEPING
        if self._probe_client is not None and replica.url is not None:
            task = asyncio.create_task(self._post_sleep(dep, replica), name=f"ember-sleep-{replica.id}")
            task.add_done_callback(retrieve)

    async def _post_sleep(self, dep: Deployment, replica: Replica) -> None:
        assert self._probe_client is not None
        try:
            response = await self._probe_client.post(f"{replica.url}/sleep", headers=auth_headers(replica.secret))
        except httpx.HTTPError as e:
            logger.info("%s: replica %s did not go to sleep (%s); it stays idle", dep.name, replica.id, e)
            return
        if response.status_code != 200:  # busy after all: it keeps its cache, which costs only memory
            logger.info("%s: replica %s refused to sleep: %s", dep.name, replica.id, response.text[:200])
