"""One LSE replica: an ordinary engine (lse_open with its own pool) under the lse-server app, in a Ray actor.

The ingress hands it whole HTTP requests (forward.ForwardedRequest); ``call`` runs each through the app and
streams back its ASGI messages. Ray polls ``record_routing_stats`` every ROUTING_STATS_PERIOD_S for the
router and /v1/lse/status: the replica's devices, load and fallback counters, as lse_status reports them.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator
from typing import Any

import ray
from ray import serve
from starlette.types import Message

from lse_core.config import LSEConfig
from lse_core.errors import StartupError
from lse_core.model.catalog import ModelSpec, model_id
from lse_core.model_set import ModelSet
from lse_http.app import create_app
from lse_ray.forward import ForwardedRequest, run_asgi


class LSEReplica:
    """``engine``: LSEConfig's fields; ``server``: create_app's options (api_key, allowed_hosts, ...)."""

    async def __init__(self, engine: dict[str, Any], server: dict[str, Any]) -> None:
        config = LSEConfig(**engine)
        self.models = ModelSet([ModelSpec(config.model_id or model_id(config.model), config.model)], config)
        self.app = create_app(self.models, **server)
        self._lifespan = self.app.router.lifespan_context(self.app)
        await self._lifespan.__aenter__()   # opens the engine in a thread; the replica is ready once it is open
        try:
            await asyncio.wrap_future(self.app.state.starting)
        except Exception as e:   # the deployment fails with the model's one-line startup reason
            raise StartupError(str(e)) from None
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        self.node_id = ray.get_runtime_context().get_node_id()

    async def call(self, request: ForwardedRequest) -> AsyncIterator[Message]:
        async for message in run_asgi(self.app, request):
            yield message

    def record_routing_stats(self) -> dict[str, Any]:
        """This replica's entry in /v1/lse/status's ``replicas``."""
        status = self.models.status()
        return {"replica": self.replica_id, "node": self.node_id, "pid": os.getpid(),
                **{k: status[k] for k in ("devices", "engine", "stats")}}

    async def __del__(self) -> None:
        await self._lifespan.__aexit__(None, None, None)   # closes the engine
