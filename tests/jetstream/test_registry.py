"""The registry's key listing (`JetStreamStore.registry`, `keys_under`): a store opened
right after another wrote, created and deleted entries lists exactly the live ones.

A front that restarts lists the registry to rebuild its topics, and removes every stream
no listed entry names (an orphan): a listing that misses a key loses that topic. nats-py's
`kv.keys()` could end its listing before the keys its ordered consumer had already been
sent, and return none; the listing is now the bucket stream's subjects, from its leader
(STREAM.INFO with a subject filter, in pages). The first test lists with fresh stores
right after writes, round after round (each round a new store on another server); the
second drives the page loop with a fake server answering in small pages, since a real
server's page holds 100,000 subjects.
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

import orjson
import pytest

from tests.jetstream.conftest import jetstream_config
from topicd.storage.jetstream import JetStreamStore

pytestmark = pytest.mark.slow

ROUNDS = 40
PER_ROUND = 3


async def _open(cfg: Any, first: int) -> JetStreamStore:
    """A store connected with `first`'s server listed first."""
    servers = cfg.storage.jetstream.servers
    order = servers[first % len(servers) :] + servers[: first % len(servers)]
    js = dataclasses.replace(cfg.storage.jetstream, servers=order)
    store = JetStreamStore(
        dataclasses.replace(cfg, storage=dataclasses.replace(cfg.storage, jetstream=js))
    )
    await store.connect()
    await store.open_registry()
    return store


def test_a_store_opened_right_after_writes_lists_every_entry(cluster):
    cfg = jetstream_config(cluster)

    async def run() -> None:
        writer = await _open(cfg, 0)
        live: dict[int, int] = {}  # topic id -> the round that wrote it
        last = 0
        try:
            for rnd in range(ROUNDS):
                for _ in range(PER_ROUND):
                    tid = await writer.allocate_id(0)
                    await writer.put_entry(tid, {"name": f"t{tid}", "round": rnd}, None)
                    live[tid] = rnd
                    last = tid
                if rnd % 3 == 2:  # some go, and must not be listed any more
                    for tid in sorted(live)[::4]:
                        await writer.delete_entry(tid)
                        del live[tid]
                reader = await _open(cfg, rnd + 1)  # (a restarting front, on any server)
                try:
                    next_id, entries = await reader.registry()
                    ids = await reader.entry_ids()
                finally:
                    await reader.close()
                assert sorted(entries) == sorted(live), f"round {rnd}"
                assert ids == set(live), f"round {rnd}"
                assert all(entries[t]["round"] == live[t] for t in live)
                assert next_id == last + 1
        finally:
            await writer.close()

    asyncio.run(run())


class _PagedServer:
    """`nc.request` of a server answering STREAM.INFO's subject listing `page` subjects
    at a time from `offset`, with the paged response's `total` (as nats-server does, at
    100,000 a page)."""

    def __init__(self, subjects: list[str], page: int) -> None:
        self.subjects = subjects
        self.page = page
        self.offsets: list[int] = []

    async def request(self, subject: str, payload: bytes, **kw: object) -> Any:
        req = orjson.loads(payload)
        prefix = req["subjects_filter"].rstrip("*")
        assert subject.startswith("$JS.API.STREAM.INFO.KV_")
        matching = [s for s in self.subjects if s.startswith(prefix)]
        offset = int(req.get("offset", 0))
        self.offsets.append(offset)
        part = matching[offset : offset + self.page]
        body = {
            "total": len(matching),
            "offset": offset,
            "limit": self.page,
            "state": {"subjects": dict.fromkeys(part, 1) or None},
        }
        return type("Msg", (), {"data": orjson.dumps(body)})()


@pytest.mark.parametrize(("count", "page"), [(0, 3), (1, 3), (3, 3), (10, 3), (7, 100)])
def test_keys_under_reads_every_page(count, page):
    cfg = jetstream_config("nats://127.0.0.1:4222", prefix="tpaged")
    store = JetStreamStore(cfg)
    pre = "$KV.tpaged_registry."
    keys = [f"{pre}topic.{i}" for i in range(count)]
    server = _PagedServer([*keys, f"{pre}meta.next_id", f"{pre}name.6869"], page)
    store.nc = server  # type: ignore[assignment]
    got = asyncio.run(store.keys_under("topic."))
    assert sorted(got) == sorted(str(i) for i in range(count))
    pages = max(1, -(-count // page))
    assert server.offsets == [i * page for i in range(pages)]


def test_keys_under_raises_on_an_error_answer():
    cfg = jetstream_config("nats://127.0.0.1:4222", prefix="terr")
    store = JetStreamStore(cfg)

    class _Refusing:
        async def request(self, subject: str, payload: bytes, **kw: object) -> Any:
            body = {"error": {"code": 404, "description": "stream not found"}}
            return type("Msg", (), {"data": orjson.dumps(body)})()

    store.nc = _Refusing()  # type: ignore[assignment]
    with pytest.raises(RuntimeError, match="stream not found"):
        asyncio.run(store.keys_under("topic."))


def test_a_create_that_finds_the_key_purged_meanwhile_is_a_conflict():
    # nats-py's `create`, refused (wrong last sequence), reads the key to see whether it
    # was deleted; a key purged in between raised `KeyNotFoundError` through it, which
    # callers took for a failure (503) instead of the conflict it is
    import nats.js.errors

    cfg = jetstream_config("nats://127.0.0.1:4222", prefix="tcreate")
    store = JetStreamStore(cfg)

    class _Racing:
        async def create(self, key: str, value: bytes) -> int:
            raise nats.js.errors.KeyNotFoundError

    store.kv = _Racing()  # type: ignore[assignment]
    with pytest.raises(nats.js.errors.KeyWrongLastSequenceError):
        asyncio.run(store.create_key("meta.graph", b"{}"))
