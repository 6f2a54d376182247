"""Smoke test of the full in-process stack: write, read back, state."""

from __future__ import annotations


async def test_write_then_diff(client):
    r = await client.post("/v0/topics/t1", json={"records": [{"data": {"a": 1}}]})
    assert r.status_code == 201
    body = await r.get_json()
    assert body["seqs"] == [1]
    r = await client.post("/v0/topics/t1/diff", json={})
    body = await r.get_json()
    assert [rec["data"] for rec in body["records"]] == [{"a": 1}]
    assert r.headers["X-Topicd-Pressure"] == "0.000"
