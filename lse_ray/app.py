"""The Ray Serve application: N LSE replicas behind one ingress. ``build`` is its application builder, so
``serve run lse_ray.app:build replicas=2`` and a Serve config file's ``import_path: lse_ray.app:build`` both
work, and lse-server --replicas calls it too.

Its arguments (all optional):
  engine               LSEConfig's fields for every replica (model, pool, kv_len, parallel, max_tokens, ...)
  server               lse-server's app options (api_key, allowed_hosts, cors_origins, stall_timeout)
  replicas             how many replicas (default 1), unless autoscaling_config is given
  autoscaling_config   Ray Serve's autoscaling config for the replicas (min/max_replicas,
                       target_ongoing_requests, ...)
  ray_actor_options    each replica's Ray resources (num_cpus, num_gpus, resources, ...); default one CPU
  max_ongoing_requests requests Ray sends one replica at once (default: twice engine.parallel)
  prefix_affinity      route by prompt prefix (default true); false: every request to the least loaded
"""

from __future__ import annotations

from typing import Any

from ray import serve
from ray.serve.config import RequestRouterConfig
from ray.serve.deployment import Application

from lse_core.config import LSEConfig
from lse_ray.ingress import LSEIngress
from lse_ray.replica import LSEReplica
from lse_ray.router import PrefixAffinityRouter

REPLICA_DEPLOYMENT = "LSEReplica"
CONSTRUCTOR_RETRIES = 3         # a replica that cannot open its engine (a bad model, pool) fails the deployment
ROUTING_STATS_PERIOD_S = 1.0    # how often Ray reads each replica's load for the router and /v1/lse/status


def build(args: dict[str, Any]) -> Application:
    engine = dict(args.get("engine") or {})
    autoscaling = args.get("autoscaling_config")
    parallel = engine.get("parallel", LSEConfig.parallel)
    replica = serve.deployment(
        LSEReplica, name=REPLICA_DEPLOYMENT,
        num_replicas=None if autoscaling else int(args.get("replicas", 1)),
        autoscaling_config=autoscaling,
        ray_actor_options=args.get("ray_actor_options") or {"num_cpus": 1},
        max_ongoing_requests=int(args.get("max_ongoing_requests") or 2 * parallel),
        max_constructor_retry_count=CONSTRUCTOR_RETRIES,
        request_router_config=RequestRouterConfig(request_router_class=PrefixAffinityRouter,
                                                  request_routing_stats_period_s=ROUTING_STATS_PERIOD_S))
    # the ingress only relays bytes: it needs no CPU of its own reserved
    ingress = serve.deployment(LSEIngress, name="LSEIngress", ray_actor_options={"num_cpus": 0},
                               max_ongoing_requests=1000)
    return ingress.bind(replica.bind(engine, dict(args.get("server") or {})), engine.get("model"), REPLICA_DEPLOYMENT,
                        bool(args.get("prefix_affinity", True)))
