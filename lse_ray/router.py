"""Ray Serve's request router for LSE replicas: prefix affinity bounded by load, least-loaded otherwise.

Ray Serve calls ``choose_replicas`` with the replicas that are up and the pending request (the ingress's
ForwardedRequest); it returns ranks of replicas, and Ray sends the request to the least-loaded replica of
the first rank that accepts it (its queue below max_ongoing_requests), probing queue lengths as it does for
its own routers. A keyed request ranks first the replica its key prefers by rendezvous hashing, passing over
any whose queue is too long (affinity.bounded_choice), so a hot prefix spills to its next replica rather than
piling up; the other replicas are the second rank. Unkeyed requests go to the least loaded.
"""

from __future__ import annotations

import importlib
import random
from typing import Any

from ray.serve.request_router import FIFOMixin, PendingRequest, RequestRouter, RunningReplica

from lse_ray.affinity import bounded_choice

# Each process's routers by deployment name: the ingress reads its replicas' routing stats from here.
ROUTERS: dict[str, PrefixAffinityRouter] = {}


class PrefixAffinityRouter(FIFOMixin, RequestRouter):
    def initialize_state(self, **kwargs: Any) -> None:
        # Ray pickles a router class by value, so these globals are a copy: register in the module imported
        importlib.import_module(__name__).ROUTERS[self._deployment_id.name] = self

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        key = _affinity_key(pending_request)
        if key is None or len(candidate_replicas) < 2:
            # Ray takes the first of the least loaded: shuffled, idle replicas share the unkeyed requests
            return [random.sample(candidate_replicas, len(candidate_replicas))]
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        preferred = bounded_choice(key, {rid: self.replica_queue_len_cache.get(r.replica_id) or 0
                                         for rid, r in by_id.items()})
        return [[by_id[preferred]], [r for rid, r in by_id.items() if rid != preferred]]

    def replica_stats(self) -> list[dict[str, Any]]:
        """What each replica last reported (LSEReplica.record_routing_stats), in replica-id order."""
        replicas = sorted(self.curr_replicas.values(), key=lambda r: r.replica_id.unique_id)
        return [r.routing_stats for r in replicas if r.routing_stats]


def _affinity_key(pending_request: PendingRequest | None) -> int | None:
    if pending_request is None or not pending_request.args:
        return None
    return getattr(pending_request.args[0], "affinity_key", None)
