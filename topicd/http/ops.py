"""Probes (api-ops §1-§2): liveness and readiness. Control class: they read published
values only and never wait on the engine."""

from __future__ import annotations

from typing import TYPE_CHECKING

import trio

from topicd import __version__
from topicd.errors import JsonValue, NotReady, ShuttingDown
from topicd.http.app import json_response
from topicd.lifecycle import Lifecycle, Phase

if TYPE_CHECKING:
    from quart import Response
    from quart_trio import QuartTrio

    from topicd.config import Config
    from topicd.http.app import EngineRef


def probe_payload(
    path: str, ref: EngineRef, config: Config, lifecycle: Lifecycle
) -> dict[str, JsonValue]:
    """The answer of a probe path (without `performance`), or the `TopicdError` it is."""
    if path in ("/v0/health", "/healthz"):
        return {"status": "ok", "version": __version__, "uptime_ms": lifecycle.uptime_ms()}
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
        return body
    if phase in (Phase.STARTING, Phase.FAILED):
        raise NotReady(
            "recovery in progress" if phase is Phase.STARTING else "recovery failed",
            {"replay_progress": round(lifecycle.replay_progress, 4)},
        )
    raise ShuttingDown("the server is shutting down")


async def probe_answer(
    path: str, ref: EngineRef, config: Config, lifecycle: Lifecycle
) -> dict[str, JsonValue]:
    """`probe_payload`, with the readiness probe's topic count taken from the shared
    storage on a process that is one of several on it (one bounded round trip there;
    its own count when that takes too long); other processes answer from memory."""
    body = probe_payload(path, ref, config, lifecycle)
    if "topics" in body and ref.engine.forward is not None:
        body["topics"] = await ref.engine.topic_count()
    else:
        await trio.lowlevel.checkpoint()
    return body


def register(app: QuartTrio, ref: EngineRef, config: Config, lifecycle: Lifecycle) -> None:
    # GET is answered by the gate itself (`Gate.probe`, no framework work: control class);
    # these routes serve HEAD and make other methods answer 405
    async def health() -> Response:
        return json_response(probe_payload("/v0/health", ref, config, lifecycle))

    async def ready() -> Response:
        return json_response(await probe_answer("/v0/ready", ref, config, lifecycle))

    app.add_url_rule("/v0/health", "health", health, methods=["GET"])
    app.add_url_rule("/healthz", "healthz", health, methods=["GET"])
    app.add_url_rule("/v0/ready", "ready", ready, methods=["GET"])
    app.add_url_rule("/readyz", "readyz", ready, methods=["GET"])
