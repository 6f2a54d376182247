"""Hypothesis: any interleaving of writes, deletes, evictions, checkpoints and restarts
reads back the same records as an in-memory model.

Method: Hypothesis draws a list of operations over two topics — `capped` (`disk`,
`cap_records` 6: writes evict) and `plain` (`fsync`) — with tiny segment triggers and WAL files
(3 records), so absorbs, seals, delete-flag flips, whole-segment drops and WAL trimming
all happen within a few steps. The engine runs on `FakeDisk`; a restart is either clean
(final checkpoint) or a process crash (`sync_all` then a power cut: what `kill -9`
leaves, written bytes kept). The model applies each acknowledged operation to a dict of
live `seq → (data, tag)` per topic. After every restart, and at the end, every topic's
readable records (seq and data) must equal the model's. The plain run also draws
whether topics start inline (`storage.segments.inline_max_bytes` 1000: records in the
snapshot until about three records, then moved into segments once).

At every restart and at the end, recovery from the segments' `.meta` side files must
rebuild exactly the state (runs, extras, counts, segment indexes) that decoding every
segment frame rebuilds (the same directory with its `.meta` files removed).

The same run goes through a tiny payload cache (2-seq chunks, a bound of 0 to a few
records): absorbed records leave memory at each checkpoint and every read — including
the `read` steps between the others — loads them back from the segments, and the cache
never counts more than its bound once a read ended. And once more with a cold tier
keeping 0 or 1 sealed segments per topic hot (cache bound 0), so checkpoints relocate
segments, deletes flip flags in cold files, drops remove them, and reads and restarts
load records back from the cold directory.
"""

from __future__ import annotations

import dataclasses

import msgspec
import orjson
import pytest
import trio
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from tests.storage.test_checkpoint import cp
from topicd.config import TieringConfig
from topicd.engine import payloads
from topicd.engine.engine import Engine
from topicd.storage.recovery import recover
from topicd.testing.fake_clock import FakeWallClock
from topicd.testing.fake_fs import FakeDisk
from topicd.testing.harness import durable_config, open_durable
from topicd.wire import DeleteIn, DiffIn, RecordIn, TopicConfigIn, WriteIn

TOPICS = ("capped", "plain")
CAP = 6
TAGS = ("a", "b", "c")

ops = st.lists(
    st.one_of(
        st.tuples(
            st.just("write"), st.sampled_from(TOPICS), st.integers(1, 4), st.sampled_from(TAGS)
        ),
        st.tuples(st.just("del_tag"), st.sampled_from(TOPICS), st.sampled_from(TAGS)),
        st.tuples(st.just("del_before"), st.sampled_from(TOPICS), st.integers(0, 6)),
        st.tuples(st.just("checkpoint")),
        st.tuples(st.just("read")),
        st.tuples(st.just("restart"), st.booleans()),
    ),
    min_size=1,
    max_size=50,
)


def config(cache_bytes: int = 1 << 28, retain: int | None = None, inline: int = 0):
    cfg = durable_config(wal={"file_bytes": 4096}, segments={"inline_max_bytes": inline})
    seg = dataclasses.replace(cfg.storage.segments, max_events=3)
    storage = dataclasses.replace(cfg.storage, segments=seg, payload_cache_bytes=cache_bytes)
    if retain is not None:  # a cold tier keeping `retain` sealed segments per topic hot
        tiering = TieringConfig(hot_retain_segments=retain)
        storage = dataclasses.replace(storage, cold_dir="/cold", tiering=tiering)
    return dataclasses.replace(cfg, storage=storage)


async def readback(engine: Engine, name: str) -> dict[int, bytes]:
    if name not in engine.topics:
        return {}
    out: dict[int, bytes] = {}
    cursor = 0
    while True:
        _, res = await engine.diff(name, DiffIn(from_seq=cursor, limit=1000))
        for rec in res.records:
            obj = orjson.loads(rec)
            out[obj["$seq"]] = orjson.dumps(obj["data"])
        cursor = res.next_from_seq
        if res.caught_up:
            return out


def recovered_state(disk: FakeDisk, cfg: object, *, strip_meta: bool) -> dict[str, object]:
    """Recover a copy of `disk`'s durable image (without its `.meta` files: from the
    frames) and dump the engine's and the segments' internal state."""
    copy = FakeDisk()
    copy.restore(disk.snapshot())
    if strip_meta:
        for path in copy.tree():
            if path.endswith(".meta"):
                copy.unlink(path)
    result = recover(cfg, copy, FakeWallClock(), boot_id="boot-1")  # type: ignore[arg-type]
    out: dict[str, object] = {}
    for name, t in result.engine.topics.items():
        out[name] = (
            t.head_seq,
            t.earliest_seq,
            t.evict_floor,
            t.count,
            t.bytes,
            [
                (
                    r.base,
                    [e if isinstance(e, bytes | None) else "E" for e in r.encs],
                    list(r.ts),
                    list(r.sizes),
                )
                for r in t.runs
            ],
            dict(t.tags),
            dict(t.nodes),
            dict(t.prios),
            dict(t.shapes),
        )
    assert result.segments is not None
    for tid, tsegs in result.segments.topics.items():
        out[f"segments {tid}"] = (
            tsegs.absorbed,
            [
                (
                    s.first,
                    s.last,
                    s.data_len,
                    s.sealed,
                    s.created_ms,
                    list(s.offsets),
                    list(s.lens),
                    list(s.ts),
                    bytes(s.flags),
                )
                for s in tsegs.segments
            ],
        )
    if not strip_meta:  # every segment was loaded from its `.meta`: none re-made
        assert result.segment_metas == []
    else:
        assert len(result.segment_metas) == sum(
            len(t.segments) for t in result.segments.topics.values()
        )
    return out


def check_meta_like_frames(disk: FakeDisk, cfg: object) -> None:
    from_meta = recovered_state(disk, cfg, strip_meta=False)
    assert from_meta == recovered_state(disk, cfg, strip_meta=True)


async def run(
    operations: list[tuple[object, ...]],
    cache_bytes: int = 1 << 28,
    retain: int | None = None,
    inline: int = 0,
) -> int:
    """Run `operations` against the model; returns the payload cache misses it took (with
    `retain`: the cold-tier segment reads)."""
    disk = FakeDisk()
    misses = 0
    cfg = config(cache_bytes, retain, inline)
    model: dict[str, dict[int, tuple[bytes, str]]] = {t: {} for t in TOPICS}
    heads = dict.fromkeys(TOPICS, 0)
    counter = 0

    async def check(engine: Engine) -> None:
        for name in TOPICS:
            want = {seq: data for seq, (data, _) in model[name].items()}
            assert await readback(engine, name) == want, name
        assert engine.payloads.bytes <= cache_bytes
        nonlocal misses
        if retain is None:
            misses += engine.payloads.misses
        else:
            misses += cp(engine).segments.cold_reads

    engine_cm = open_durable(disk, cfg)
    engine = await engine_cm.__aenter__()
    try:
        await engine.put_topic("capped", TopicConfigIn(cap_records=CAP))
        await engine.put_topic("plain", TopicConfigIn(durable=True))
        for op in operations:
            kind = op[0]
            if kind == "write":
                _, name, n, tag = op
                assert isinstance(name, str) and isinstance(n, int) and isinstance(tag, str)
                datas = []
                for _ in range(n):
                    counter += 1
                    datas.append(b'"%d-%s"' % (counter, b"p" * 300))  # WAL files fill fast
                res = await engine.append(
                    name,
                    WriteIn(records=[RecordIn(data=msgspec.Raw(d), tag=tag) for d in datas]),
                )
                for i, d in enumerate(datas):
                    model[name][res.first_seq + i] = (d, tag)
                heads[name] = res.last_seq
                if name == "capped":
                    while len(model[name]) > CAP:
                        del model[name][min(model[name])]
            elif kind == "del_tag":
                _, name, tag = op
                assert isinstance(name, str) and isinstance(tag, str)
                if heads[name]:
                    await engine.delete_records(name, DeleteIn(match=tag))
                    model[name] = {s: v for s, v in model[name].items() if v[1] != tag}
            elif kind == "del_before":
                _, name, back = op
                assert isinstance(name, str) and isinstance(back, int)
                if heads[name]:
                    before = max(1, heads[name] - back)
                    await engine.delete_records(name, DeleteIn(before_seq=before))
                    model[name] = {s: v for s, v in model[name].items() if s >= before}
            elif kind == "checkpoint":  # twice: the second trims the WAL behind the first
                assert await cp(engine).checkpoint()
                assert await cp(engine).checkpoint()
            elif kind == "read":
                await check(engine)
            else:
                (_, clean) = op
                if clean:
                    await engine_cm.__aexit__(None, None, None)
                else:  # a process crash: written bytes survive, nothing else runs
                    disk.sync_all()
                    disk.crash(power_off=True)
                    await engine_cm.__aexit__(None, None, None)
                    disk.reboot()
                check_meta_like_frames(disk, cfg)
                engine_cm = open_durable(disk, cfg)
                engine = await engine_cm.__aenter__()
                await check(engine)
        await check(engine)
    finally:
        await engine_cm.__aexit__(None, None, None)
    check_meta_like_frames(disk, cfg)
    engine_cm = open_durable(disk, cfg)
    engine = await engine_cm.__aenter__()
    try:
        await check(engine)
    finally:
        await engine_cm.__aexit__(None, None, None)
    return misses


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops, st.sampled_from([0, 1000]))
@example(  # a delete that must outlive the trimming of the WAL file that held it
    [
        ("write", "plain", 4, "a"),
        ("write", "plain", 1, "b"),
        ("checkpoint",),
        ("del_tag", "plain", "b"),
        ("checkpoint",),
        *[("write", "plain", 4, "a")] * 10,
        ("checkpoint",),
        ("restart", False),
    ],
    0,
)
@example(  # inline topics (~3 records) that outgrow it, across deletes and a crash
    [
        ("write", "plain", 2, "a"),
        ("write", "capped", 2, "b"),
        ("checkpoint",),
        ("del_tag", "plain", "a"),
        ("write", "plain", 4, "b"),
        ("restart", False),
        ("write", "capped", 4, "a"),
        ("checkpoint",),
        ("del_before", "capped", 2),
        ("restart", False),
        ("checkpoint",),
    ],
    1000,
)
def test_interleavings_read_back_like_the_model(operations, inline):
    """`inline` 1000: a topic keeps its records in the snapshot until they pass ~3
    records, then moves into segments (`storage.segments.inline_max_bytes`)."""
    trio.run(run, operations, 1 << 28, None, inline)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops, st.sampled_from([0, 400, 1500]))
def test_interleavings_read_back_like_the_model_through_a_tiny_payload_cache(
    operations, cache_bytes
):
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(payloads, "CHUNK_SHIFT", 1)
        trio.run(run, operations, cache_bytes)


def test_the_tiny_cache_run_really_reads_evicted_records_back():
    operations = [
        *[("write", "plain", 4, "a")] * 3,
        ("checkpoint",),
        ("read",),
        ("del_tag", "plain", "a"),
        ("write", "capped", 4, "b"),
        ("checkpoint",),
        ("restart", False),
    ]
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(payloads, "CHUNK_SHIFT", 1)
        assert trio.run(run, operations, 0) > 0


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops, st.sampled_from([0, 1]))
@example(  # a delete flag flipped in a cold segment must outlive the WAL that held it
    [
        *[("write", "plain", 1, "b"), ("write", "plain", 1, "a"), ("write", "plain", 1, "b")] * 3,
        ("checkpoint",),
        ("del_tag", "plain", "a"),
        ("checkpoint",),
        *[("write", "capped", 4, "c")] * 6,
        ("checkpoint",),
        ("restart", False),
    ],
    0,
)
def test_interleavings_read_back_like_the_model_with_a_cold_tier(operations, retain):
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(payloads, "CHUNK_SHIFT", 1)
        trio.run(run, operations, 0, retain)


def test_the_cold_tier_run_really_reads_cold_segments():
    operations = [
        *[("write", "plain", 4, "a")] * 3,
        ("checkpoint",),
        ("read",),
        ("del_tag", "plain", "a"),
        ("write", "plain", 4, "b"),
        ("checkpoint",),
        ("restart", False),
    ]
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(payloads, "CHUNK_SHIFT", 1)
        assert trio.run(run, operations, 0, 1) > 0
