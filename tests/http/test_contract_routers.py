"""Contract tests for routers: the `/v0/routers` API and forwarding as readers see it.

Method: black-box through Quart's test client on the in-process app (the `client`
fixture: in-memory commit path, `FakeWallClock`). One test per rule of the router
contract: create/configure and the identical re-PUT, the check order (400, 403, 404,
409 fan-in, 409 re-point, 429 `max_routers`, 409 `router_cycle`), GET/list/DELETE,
the cascade on topic deletion, what a copy carries, derived seqs (also with direct
writes to the destination interleaved, and with a filter), read-path catch-up (a diff
right after the source write sees the copy: no waiting on the sweep), backpressure on a
full destination and `source_trim` gaps. Nothing sleeps: catch-up is synchronous.
"""

from __future__ import annotations

import json

from topicd.testing.harness import make_config, open_app

JSON_CT = {"Content-Type": "application/json"}


async def body(r, status: int = 200) -> dict:
    raw = await r.get_data()
    assert r.status_code == status, raw
    return json.loads(raw)


async def err(r, status: int, code: str) -> dict:
    raw = await r.get_data()
    assert r.status_code == status, raw
    e = json.loads(raw)["error"]
    assert e["code"] == code, e
    return e


async def put_router(client, name: str, status: int = 201, **fields) -> dict:
    r = await client.put(f"/v0/routers/{name}", json=fields)
    return await body(r, status)


async def write(client, topic: str, *records: dict) -> dict:
    r = await client.post(f"/v0/topics/{topic}", json={"records": list(records)})
    return await body(r, r.status_code)


async def read(client, topic: str, from_seq: int = 0, **kw) -> dict:
    r = await client.post(
        f"/v0/topics/{topic}/diff", json={"from_seq": from_seq, "limit": 1000, **kw}
    )
    return await body(r)


ROUTER_FIELDS = {
    "router",
    "source",
    "dest",
    "preserve_node",
    "preserve_tag",
    "filter",
    "allow_cycle",
    "guarantee",
}


# ---- create / configure ---------------------------------------------------------------


async def test_put_creates_and_echoes_every_field(client):
    out = await put_router(client, "a->b", source="a", dest="b")
    assert out["created"] is True
    assert ROUTER_FIELDS | {"created", "performance"} == set(out)
    assert out["filter"] is None  # no omit-when-absent
    assert (out["preserve_node"], out["preserve_tag"], out["allow_cycle"]) == (True, True, False)
    assert out["guarantee"] == "at_least_once"
    assert "create_dest" not in out
    # both topics were auto-created
    assert (await client.get("/v0/topics/a")).status_code == 200
    assert (await client.get("/v0/topics/b")).status_code == 200


async def test_two_routers_auto_creating_one_source_at_once_both_land(harness, monkeypatch):
    """Two `PUT`s of different routers naming one absent source, the first one's
    creation of it held until the second has asked to create it too: the second waits
    for that creation (it must not loop without yielding, which would block the event
    loop and the held creation with it), and both routers are created on the one topic."""
    import trio

    engine, commit = harness.engine, harness.engine.commit
    asked = 0
    both_asked = trio.Event()
    real_default, real_control = engine.create_default, commit.control

    async def create_default(name: str):
        nonlocal asked
        if name == "src":
            asked += 1
            assert asked <= 2, "a caller spins on the source's creation without yielding"
            if asked == 2:
                both_asked.set()
        return await real_default(name)

    async def control(topic, frame, apply, **kw):
        if topic.name == "src" and not both_asked.is_set():
            await both_asked.wait()  # (the first creation of the source, held)
        return await real_control(topic, frame, apply, **kw)

    monkeypatch.setattr(engine, "create_default", create_default)
    monkeypatch.setattr(commit, "control", control)
    client = harness.app.test_client()
    got: dict[str, int] = {}

    async def put(name: str, dest: str) -> None:
        r = await client.put(f"/v0/routers/{name}", json={"source": "src", "dest": dest})
        got[name] = r.status_code

    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(put, "r1", "d1")
            nursery.start_soon(put, "r2", "d2")
    assert got == {"r1": 201, "r2": 201}
    assert asked == 2
    await write(client, "src", {"data": 1})
    for d in ("d1", "d2"):
        assert [x["data"] for x in (await read(client, d))["records"]] == [1]
    assert (await body(await client.get("/v0/topics/src")))["head_seq"] == 1


async def test_put_identical_is_200_noop_that_keeps_the_cursor(client):
    await put_router(client, "a->b", source="a", dest="b")
    await write(client, "a", {"data": 1}, {"data": 2})
    before = await body(await client.get("/v0/routers/a->b"))
    again = await put_router(client, "a->b", 200, source="a", dest="b")
    assert again["created"] is False
    after = await body(await client.get("/v0/routers/a->b"))
    assert after["forwarded_total"] == before["forwarded_total"]
    assert [r["$seq"] for r in (await read(client, "b"))["records"]] == [1, 2]


async def test_other_fields_are_mutable_by_reput(client):
    await put_router(client, "a->b", source="a", dest="b")
    out = await put_router(
        client, "a->b", 200, source="a", dest="b", preserve_tag=False, filter="eu:*"
    )
    assert out["preserve_tag"] is False
    assert out["filter"] == ["tag", "Glob", "eu:*"]


async def test_no_backfill_the_cursor_starts_at_the_source_head(client):
    await write(client, "a", {"data": "old"})
    await put_router(client, "a->b", source="a", dest="b")
    await write(client, "a", {"data": "new"})
    recs = (await read(client, "b"))["records"]
    assert [r["data"] for r in recs] == ["new"]


# ---- checks, in order -------------------------------------------------------------------


async def test_bad_names_and_same_source_dest_are_400(client):
    await err(
        await client.put("/v0/routers/%20x", json={"source": "a", "dest": "b"}),
        400,
        "invalid_request",
    )
    await err(
        await client.put("/v0/routers/x", json={"source": "a", "dest": "a"}), 400, "invalid_request"
    )
    await err(
        await client.put("/v0/routers/x", json={"source": "a b", "dest": "c"}),
        400,
        "invalid_request",
    )
    await err(await client.put("/v0/routers/x", json={"dest": "c"}), 400, "invalid_request")


async def test_create_dest_false_on_absent_dest_is_404_with_the_dest(client):
    e = await err(
        await client.put("/v0/routers/x", json={"source": "a", "dest": "b", "create_dest": False}),
        404,
        "topic_not_found",
    )
    assert e["detail"]["topic"] == "b"
    assert (await client.get("/v0/topics/a")).status_code == 404  # nothing created


async def test_fan_in_from_another_source_is_409_router_dest_fan_in(client):
    await put_router(client, "a->d", source="a", dest="d")
    e = await err(
        await client.put("/v0/routers/c->d", json={"source": "c", "dest": "d"}),
        409,
        "topic_exists_incompatible",
    )
    assert e["detail"] == {"topic": "d", "reason": "router_dest_fan_in"}
    # once the router is gone, another source may feed the topic
    await client.delete("/v0/routers/a->d")
    await put_router(client, "c->d", source="c", dest="d")


async def test_two_routers_of_one_source_into_one_dest_copy_in_lockstep(client):
    await put_router(client, "r2", source="a", dest="d", preserve_tag=False)
    await put_router(client, "r1", source="a", dest="d", filter="eu:*")
    await write(client, "a", {"data": 1, "tag": "eu:x"}, {"data": 2, "tag": "us"})
    await write(client, "d", {"data": "direct"})
    await write(client, "a", {"data": 3, "tag": "eu:y"})
    res = await read(client, "d", include_tags=True)
    # per source seq, one slot per router in name order (r1, then r2); r1's filter
    # leaves a silent hole for "us"
    got = [(r["$seq"], r["data"], r.get("$tag")) for r in res["records"]]
    assert got == [
        (1, 1, "eu:x"),
        (2, 1, None),
        (4, 2, None),
        (5, "direct", None),
        (6, 3, "eu:y"),
        (7, 3, None),
    ]
    assert res["head_seq"] == 7


# ---- exactly_once ----------------------------------------------------------------------


async def test_exactly_once_copies_carry_the_topics_router_meta_key(client):
    await put_router(client, "a->b", source="a", dest="b", guarantee="exactly_once")
    many = {f"k{i}": i for i in range(64)}
    await write(
        client,
        "a",
        {"data": 1, "meta": {"m": 1}},
        {"data": 2},
        {"data": 3, "meta": [1, 2]},
        {"data": 4, "meta": many},
    )
    recs = (await read(client, "b"))["records"]
    marks = [r["meta"]["_topics_router"] for r in recs]
    assert [m["source_seq"] for m in marks] == [1, 2, 3, 4]
    first = marks[0]
    tid = first["source_topic_id"]
    assert first == {
        "idempotency_key": f"router:a->b:{tid}:1:1",
        "router": "a->b",
        "source_topic": "a",
        "source_topic_id": tid,
        "source_epoch": 1,
        "source_seq": 1,
    }
    assert recs[0]["meta"]["m"] == 1  # merged into an object meta
    assert set(recs[1]["meta"]) == {"_topics_router"}  # absent meta
    assert recs[2]["meta"]["_topics_original_meta"] == [1, 2]  # not an object
    assert recs[3]["meta"]["_topics_original_meta"] == many  # already 64 keys
    assert set(recs[3]["meta"]) == {"_topics_router", "_topics_original_meta"}
    # the source records are untouched, and at_least_once adds nothing
    assert (await read(client, "a"))["records"][0]["meta"] == {"m": 1}
    await put_router(client, "a->c", source="a", dest="c")
    await write(client, "a", {"data": 5})
    assert "meta" not in (await read(client, "c"))["records"][0]


async def test_exactly_once_through_a_chain_keeps_one_marker_of_the_last_hop(client):
    await put_router(client, "a->b", source="a", dest="b", guarantee="exactly_once")
    await put_router(client, "b->c", source="b", dest="c", guarantee="exactly_once")
    await write(client, "a", {"data": 1, "meta": {"m": 1}})
    rec = (await read(client, "c"))["records"][0]
    assert rec["meta"]["m"] == 1
    assert rec["meta"]["_topics_router"]["router"] == "b->c"


async def test_repoint_is_409_with_the_existing_endpoints(client):
    await put_router(client, "r", source="a", dest="b")
    e = await err(
        await client.put("/v0/routers/r", json={"source": "a", "dest": "c"}),
        409,
        "topic_exists_incompatible",
    )
    assert e["detail"] == {
        "router": "r",
        "reason": "router_repoint_forbidden",
        "existing_source": "a",
        "existing_dest": "b",
    }


async def test_max_routers_is_429_limit():
    async with open_app(make_config(limits={"max_routers": 1})) as h:
        client = h.app.test_client()
        await put_router(client, "a->b", source="a", dest="b")
        e = await err(
            await client.put("/v0/routers/c->d", json={"source": "c", "dest": "d"}),
            429,
            "throttled",
        )
        assert e["detail"] == {"limit": "max_routers", "max": 1}
        # updating an existing router always works
        await put_router(client, "a->b", 200, source="a", dest="b", preserve_tag=False)


async def test_a_cycle_is_409_router_cycle_with_the_path(client):
    await put_router(client, "p->q", source="p", dest="q")
    await put_router(client, "q->r", source="q", dest="r")
    e = await err(
        await client.put("/v0/routers/r->p", json={"source": "r", "dest": "p"}),
        409,
        "router_cycle",
    )
    assert e["detail"]["cycle"] == ["r", "p", "q", "r"]
    assert (await client.get("/v0/routers/r->p")).status_code == 404  # nothing created


async def test_allow_cycle_loops_stop_at_the_hop_cap(client):
    await put_router(client, "p->q", source="p", dest="q")
    await put_router(client, "q->p", source="q", dest="p", allow_cycle=True)
    await write(client, "p", {"data": 1})
    p = await read(client, "p")
    q = await read(client, "q")
    # the record crossed 8 hops in all: p(0) q(1) p(2) q(3) p(4) q(5) p(6) q(7) p(8)
    assert len(p["records"]) == 5
    assert len(q["records"]) == 4


# ---- GET / list / DELETE ---------------------------------------------------------------


async def test_get_has_forwarded_total_and_absent_is_router_not_found(client):
    await put_router(client, "a->b", source="a", dest="b", filter=["tag", "Eq", "x"])
    await write(client, "a", {"data": 1, "tag": "x"}, {"data": 2})
    out = await body(await client.get("/v0/routers/a->b"))
    assert ROUTER_FIELDS | {"forwarded_total", "cursor_lag", "performance"} == set(out)
    assert out["forwarded_total"] == 2  # source records handled, filtered ones included
    assert out["cursor_lag"] == 0
    e = await err(await client.get("/v0/routers/nope"), 404, "router_not_found")
    assert e["detail"] == {"router": "nope"}


async def test_list_sorts_filters_and_pages(client):
    for name, src, dst in [("c1", "s1", "d1"), ("a1", "s1", "d2"), ("b1", "s2", "d3")]:
        await put_router(client, name, source=src, dest=dst)
    out = await body(await client.get("/v0/routers"))
    assert [r["router"] for r in out["routers"]] == ["a1", "b1", "c1"]
    assert "next_cursor" not in out
    assert set(out["routers"][0]) == {"router", "source", "dest", "guarantee", "forwarded_total"}
    out = await body(await client.get("/v0/routers?source=s1"))
    assert [r["router"] for r in out["routers"]] == ["a1", "c1"]
    out = await body(await client.get("/v0/routers?dest=d3"))
    assert [r["router"] for r in out["routers"]] == ["b1"]
    out = await body(await client.get("/v0/routers?prefix=b"))
    assert [r["router"] for r in out["routers"]] == ["b1"]
    page = await body(await client.get("/v0/routers?page_size=2"))
    assert [r["router"] for r in page["routers"]] == ["a1", "b1"]
    rest = await body(await client.get(f"/v0/routers?page_size=2&cursor={page['next_cursor']}"))
    assert [r["router"] for r in rest["routers"]] == ["c1"]
    await err(await client.get("/v0/routers?cursor=!!"), 400, "invalid_request")


async def test_delete_is_idempotent_and_stops_forwarding(client):
    await put_router(client, "a->b", source="a", dest="b")
    await write(client, "a", {"data": 1})
    out = await body(await client.delete("/v0/routers/a->b"))
    assert out["deleted"] is True
    out = await body(await client.delete("/v0/routers/a->b"))
    assert out["deleted"] is False
    await write(client, "a", {"data": 2})
    assert [r["data"] for r in (await read(client, "b"))["records"]] == [1]  # copies stay


async def test_deleting_source_or_dest_removes_its_routers(client):
    await put_router(client, "a->b", source="a", dest="b")
    await put_router(client, "b->c", source="b", dest="c")
    out = await body(await client.delete("/v0/topics/b"))
    assert out["routers_removed"] == ["a->b", "b->c"]
    assert (await client.get("/v0/routers/a->b")).status_code == 404
    out = await body(await client.delete("/v0/topics/b"))
    assert out == {**out, "deleted": False, "routers_removed": []}


# ---- what a copy carries --------------------------------------------------------------


async def test_copy_gets_fresh_seq_and_keeps_data_meta_tag_node(client):
    await write(client, "b", {"data": "direct"})  # dest head 1 at creation
    await put_router(client, "a->b", source="a", dest="b")
    await write(client, "a", {"data": {"x": 1.10}, "meta": {"m": 1}, "tag": "t", "node": "n1"})
    recs = (await read(client, "b", 1, include_tags=True))["records"]
    assert len(recs) == 1
    assert recs[0]["$seq"] == 2
    assert recs[0]["data"] == {"x": 1.1}
    assert recs[0]["meta"] == {"m": 1}
    assert (recs[0]["$tag"], recs[0]["$node"]) == ("t", "n1")


async def test_preserve_flags_false_drop_node_and_tag(client):
    await put_router(client, "a->b", source="a", dest="b", preserve_node=False, preserve_tag=False)
    await write(client, "a", {"data": 1, "tag": "t", "node": "n1"})
    rec = (await read(client, "b", include_tags=True))["records"][0]
    assert "$node" not in rec
    assert "$tag" not in rec


async def test_node_filtering_applies_to_copies(client):
    await put_router(client, "a->b", source="a", dest="b")
    await write(client, "a", {"data": 1, "node": "me"}, {"data": 2, "node": "other"})
    recs = (await read(client, "b", node="me"))["records"]
    assert [r["data"] for r in recs] == [2]


# ---- seqs -----------------------------------------------------------------------------


async def test_dest_seqs_are_dest_base_plus_source_records_handled(client):
    await write(client, "b", {"data": 0}, {"data": 0})  # dest_base = 2
    await put_router(client, "a->b", source="a", dest="b", filter="eu:*")
    await write(client, "a", {"data": 1, "tag": "eu:1"}, {"data": 2, "tag": "us"})
    await write(client, "a", {"data": 3, "tag": "eu:2"}, {"data": 4})
    res = await read(client, "b", 2)
    # every handled source record takes one dest seq; filtered ones are silent holes
    assert [(r["$seq"], r["data"]) for r in res["records"]] == [(3, 1), (5, 3)]
    assert res["head_seq"] == 6
    assert res["tombstone"] is None


async def test_direct_writes_interleave_in_arrival_order(client):
    await put_router(client, "a->b", source="a", dest="b")
    await write(client, "a", {"data": "c1"})
    await read(client, "b")  # catch-up places c1 at 1
    await write(client, "b", {"data": "d1"})
    await write(client, "a", {"data": "c2"}, {"data": "c3"})
    await write(client, "b", {"data": "d2"})
    recs = (await read(client, "b"))["records"]
    # every seq holds exactly one of them; copies keep source order, direct writes theirs
    assert [r["$seq"] for r in recs] == [1, 2, 3, 4, 5]
    assert recs[1]["data"] == "d1"
    datas = [r["data"] for r in recs]
    assert [d for d in datas if d.startswith("c")] == ["c1", "c2", "c3"]
    assert [d for d in datas if d.startswith("d")] == ["d1", "d2"]


async def test_read_path_catch_up_sees_the_copy_at_once(client):
    await put_router(client, "a->b", source="a", dest="b")
    await put_router(client, "b->c", source="b", dest="c")
    await write(client, "a", {"data": 1})
    # no sweep, no drain has run: the read drains the chain a -> b -> c itself
    recs = (await read(client, "c"))["records"]
    assert [r["data"] for r in recs] == [1]


async def test_a_full_reject_dest_holds_the_cursor_never_drops(client):
    r = await client.put("/v0/topics/b", json={"cap_records": 2, "discard": "reject"})
    await body(r, 201)
    await put_router(client, "a->b", source="a", dest="b")
    await write(client, "a", {"data": 1}, {"data": 2}, {"data": 3})
    assert [x["data"] for x in (await read(client, "b"))["records"]] == [1, 2]
    state = await body(await client.get("/v0/routers/a->b"))
    assert state["cursor_lag"] == 1  # waiting, not lost
    await body(await client.post("/v0/topics/b/delete", json={"before_seq": 2}))
    assert [x["data"] for x in (await read(client, "b"))["records"]] == [2, 3]


async def test_records_the_source_evicted_first_are_source_trim(client):
    r = await client.put("/v0/topics/a", json={"cap_records": 2})
    await body(r, 201)
    await put_router(client, "a->b", source="a", dest="b")
    # four records in one write: the source cap evicts two before any forwarding
    await write(client, "a", {"data": 1}, {"data": 2}, {"data": 3}, {"data": 4})
    res = await read(client, "b")
    assert res["tombstone"] is not None
    assert res["tombstone"]["reason"] == "source_trim"
    assert (res["tombstone"]["gap_from"], res["tombstone"]["gap_to"]) == (1, 2)
    res = await read(client, "b", res["next_from_seq"])
    assert [(x["$seq"], x["data"]) for x in res["records"]] == [(3, 3), (4, 4)]


# ---- auth -----------------------------------------------------------------------------


async def test_scopes_and_prefixes_apply_to_name_source_and_dest():
    cfg = make_config(auth={"api_keys": ["adm:admin+read+delete:app.", "rd:read:app."]})
    async with open_app(cfg) as h:
        client = h.app.test_client()
        adm = {"Authorization": "Bearer adm"}
        rd = {"Authorization": "Bearer rd"}
        r = await client.put(
            "/v0/routers/app.r", json={"source": "app.a", "dest": "other"}, headers=adm
        )
        e = await err(r, 403, "forbidden")
        assert e["detail"] == {"topic": "other"}
        r = await client.put(
            "/v0/routers/x.r", json={"source": "app.a", "dest": "app.b"}, headers=adm
        )
        await err(r, 403, "forbidden")
        r = await client.put(
            "/v0/routers/app.r", json={"source": "app.a", "dest": "app.b"}, headers=rd
        )
        await err(r, 403, "forbidden")  # PUT needs admin
        r = await client.put(
            "/v0/routers/app.r", json={"source": "app.a", "dest": "app.b"}, headers=adm
        )
        await body(r, 201)
        await body(await client.get("/v0/routers/app.r", headers=rd))
        await err(await client.delete("/v0/routers/app.r", headers=rd), 403, "forbidden")
