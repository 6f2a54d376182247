"""Probes (api-ops §1-§2): liveness and readiness. Control class: they read published
values only and never wait on the engine."""

from __future__ import annotations

from typing import TYPE_CHECKING

from topicd import __version__
from topicd.errors import JsonValue, NotReady, ShuttingDown
from topicd.http.app import json_response
from topicd.lifecycle import Lifecycle, Phase

if TYPE_CHECKING:
    from quart import Response
    from quart_trio import QuartTrio

    from topicd.config import Config
    from topicd.http.app import EngineRef


def register(app: QuartTrio, ref: EngineRef, config: Config, lifecycle: Lifecycle) -> None:
    async def health() -> Response:
        return json_response(
            {"status": "ok", "version": __version__, "uptime_ms": lifecycle.uptime_ms()}
        )

    async def ready() -> Response:
        phase = lifecycle.phase.value
        if phase is Phase.SERVING:
            engine = ref.engine
            body: dict[str, JsonValue] = {
                "status": "ready",
                "wal_replay_complete": True,
                "topics": len(engine.topics),
            }
            storage = engine.commit.status()
            if storage is not None:
                body["storage"] = storage
                if config.breaker.unready_when_open:
                    engine.commit.check_all()  # 503 storage_unavailable while not closed
            return json_response(body)
        if phase in (Phase.STARTING, Phase.FAILED):
            raise NotReady(
                "recovery in progress" if phase is Phase.STARTING else "recovery failed",
                {"replay_progress": round(lifecycle.replay_progress, 4)},
            )
        raise ShuttingDown("the server is shutting down")

    app.add_url_rule("/v0/health", "health", health, methods=["GET"])
    app.add_url_rule("/healthz", "healthz", health, methods=["GET"])
    app.add_url_rule("/v0/ready", "ready", ready, methods=["GET"])
    app.add_url_rule("/readyz", "readyz", ready, methods=["GET"])
