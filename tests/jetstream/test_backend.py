"""The jetstream backend on a real nats-server: writes, reads, restarts, refusals."""

from __future__ import annotations

import pytest

from tests.jetstream.conftest import jetstream_config, open_jetstream_app

pytestmark = pytest.mark.slow


async def test_write_read_restart(nats_server):
    cfg = jetstream_config(nats_server.url)
    async with open_jetstream_app(cfg) as h:
        c = h.app.test_client()
        r = await c.post("/v0/topics/a", json={"records": [{"data": 1}, {"data": 2}]})
        assert r.status_code == 201, await r.get_data()
        r = await c.post("/v0/topics/a", json={"records": [{"data": 3}]})
        assert (await r.get_json())["first_seq"] == 3
    async with open_jetstream_app(cfg) as h:
        c = h.app.test_client()
        r = await c.post("/v0/topics/a/diff", json={"from_seq": 0})
        body = await r.get_json()
        assert [x["data"] for x in body["records"]] == [1, 2, 3], body
