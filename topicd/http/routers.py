"""Routes of `/v0/routers` (create/configure, state, list, delete): check, call, render."""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

from quart import Response, request

from topicd.http.app import decode, json_response, principal, read_body
from topicd.http.topics import _page_size, decode_list_cursor, encode_list_cursor
from topicd.wire import ROUTER_DECODER, check_router_name

if TYPE_CHECKING:
    from quart_trio import QuartTrio

    from topicd.config import Config
    from topicd.engine.router import Router
    from topicd.errors import JsonValue
    from topicd.http.app import EngineRef


def router_state(r: Router) -> dict[str, JsonValue]:
    """`GET` fields: the definition, `forwarded_total` and the `cursor_lag` extension."""
    out = r.d.fields()
    out["forwarded_total"] = r.forwarded_total
    out["cursor_lag"] = r.lag
    return out


def register(app: QuartTrio, ref: EngineRef, config: Config) -> None:
    max_body = config.limits.max_body_bytes
    proto = config.protocol

    @app.route("/v0/routers/<router>", methods=["PUT"])
    async def put_router(router: str) -> Response:
        p = principal()
        p.require("admin")
        check_router_name(router)
        body = await read_body(empty_ok=False, max_bytes=max_body)
        assert body is not None
        req = decode(ROUTER_DECODER, body)
        p.require("admin", router, detail_key="router")
        p.require("admin", req.source, req.dest)
        r, created = await ref.engine.routers.put(router, req)
        out: dict[str, JsonValue] = {"router": r.d.name, "created": created}
        out |= r.d.fields()
        return json_response(out, 201 if created else 200)

    @app.route("/v0/routers/<router>", methods=["GET"])
    async def get_router(router: str) -> Response:
        p = principal()
        p.require("read", router, detail_key="router")
        routers = ref.engine.routers
        r = await routers.lookup(router)
        p.require("read", r.d.source, r.d.dest)
        if routers.in_flight or routers.wants:  # (copies being stored: jetstream)
            await routers.settle(r.dst)
        return json_response(router_state(r))

    @app.route("/v0/routers", methods=["GET"])
    async def list_routers() -> Response:
        p = principal()
        p.require("read")
        cursor = request.args.get("cursor") or None
        after = decode_list_cursor(cursor) if cursor is not None else None
        await ref.engine.routers.sync_listing()
        items, last = ref.engine.routers.page(
            request.args.get("prefix", ""),
            request.args.get("source"),
            request.args.get("dest"),
            after,
            _page_size(proto.default_page_size, proto.max_page_size),
            p.allows_name if p.prefixes else None,
        )
        rows: list[JsonValue] = [
            {
                "router": r.d.name,
                "source": r.d.source,
                "dest": r.d.dest,
                "guarantee": r.d.guarantee,
                "forwarded_total": r.forwarded_total,
            }
            for r in items
        ]
        payload: dict[str, JsonValue] = {"routers": cast("JsonValue", rows)}
        if last is not None:
            payload["next_cursor"] = encode_list_cursor(last)
        return json_response(payload)

    @app.route("/v0/routers/<router>", methods=["DELETE"])
    async def delete_router(router: str) -> Response:
        p = principal()
        p.require("delete", router, detail_key="router")
        check_router_name(router)
        existing = await ref.engine.routers.definition(router)
        if existing is not None:
            p.require("delete", existing.source, existing.dest)
        deleted = await ref.engine.routers.delete(router)
        return json_response({"router": router, "deleted": deleted})
