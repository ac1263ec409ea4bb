"""lse-server --replicas N / --ray-address ADDR: the Ray Serve application on a local Ray instance or a cluster,
its HTTP proxy on --host/--port, until SIGTERM or SIGINT."""

from __future__ import annotations

import argparse
import dataclasses
import os
import signal
import sys
import threading
from typing import Any

from lse_core.config import LSEConfig

APP_NAME = "lse"
LOCAL_OBJECT_STORE_BYTES = 256 << 20   # a local instance moves only requests and events: keep its store small
SERVE_SHUTDOWN_TIMEOUT_S = 60.0        # for the replicas to finish their replies (Serve's graceful shutdown)


def serve_replicas(args: argparse.Namespace, config: LSEConfig, server: dict[str, Any]) -> int:
    """Run the application; 1 when it cannot start (the replicas' own startup error is printed)."""
    import ray
    from ray import serve

    from lse_core.errors import StartupError
    from lse_core.model.default import load_model
    from lse_ray.app import build

    try:   # a missing or damaged model file fails here, in one line, before Ray starts
        load_model(config.model)
    except StartupError as e:
        print(f"lse-server: {e}", file=sys.stderr)
        return 1
    if args.ray_address:
        ray.init(address=args.ray_address, logging_level=args.log_level.upper())
    else:
        ray.init(include_dashboard=False, object_store_memory=LOCAL_OBJECT_STORE_BYTES,
                 logging_level=args.log_level.upper())
    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    try:
        serve.start(http_options={"host": args.host, "port": args.port})
        engine = dataclasses.asdict(config)
        if config.model is not None:   # Ray's workers do not start in this directory
            engine["model"] = os.path.abspath(config.model)
        serve.run(build({"engine": engine, "server": server, "replicas": args.replicas or 1,
                         "autoscaling_config": args.autoscaling_config,
                         "ray_actor_options": args.ray_actor_options,
                         "prefix_affinity": not args.no_prefix_affinity}), name=APP_NAME, route_prefix="/")
        print(f"lse-server: serving on http://{args.host}:{args.port} through Ray Serve", file=sys.stderr, flush=True)
        stop.wait()
        return 0
    except RuntimeError as e:   # a deployment that failed to start: Serve's message carries the replica's error
        print(f"lse-server: the replicas did not start: {e}", file=sys.stderr, flush=True)
        return 1
    finally:
        # bounded: with the local raylet gone (a signal to the whole process group) Serve's shutdown never returns
        stopping = threading.Thread(target=serve.shutdown, daemon=True)
        stopping.start()
        stopping.join(SERVE_SHUTDOWN_TIMEOUT_S)
        ray.shutdown()
