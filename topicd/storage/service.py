"""Open durable storage: recover, then run the engine on the write-ahead log.

`open_durable_engine` is the storage subsystem's one entry point (STYLE §2: a subsystem is
an async context manager owning one nursery). It

1. runs recovery — in a worker thread in production (`recover_in_thread=True`), inline in
   deterministic tests over `FakeDisk` — reporting progress through `progress`;
2. records this boot and the data format (`prepare_data_dir`);
3. attaches a `WalCommitPath` to the recovered engine and starts its committers and the
   engine's housekeeping;
4. writes and syncs a `LostRange` frame for every range recovery found, before yielding
   (so readiness never precedes them);
5. runs the checkpointer (snapshots that let the WAL be trimmed);
6. on exit closes the engine to new mutations, lets every committer drain its accepted
   submissions and run a final `fdatasync`, then takes a final snapshot (together bounded
   by `storage.snapshot.final_timeout_ms`, shielded), then cancels the rest.
"""

from __future__ import annotations

import logging
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Final

import trio

from topicd.storage import frame as frames
from topicd.storage import segments as segs
from topicd.storage import snapshot
from topicd.storage.checkpoint import Checkpointer, retire_wal
from topicd.storage.recovery import RecoveryResult, prepare_data_dir, record_boot, recover
from topicd.storage.wal import ShardFiles, WalCommitPath

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Callable

    from topicd.clock import WallClock
    from topicd.config import Config
    from topicd.engine.engine import Engine
    from topicd.offload import Offload
    from topicd.storage.fs import Fs

log = logging.getLogger("topicd.storage")

# threads that load registered segments during a recovery run in a thread (their reads
# overlap: after a cold start each is a few small random reads, `recovery.recover`)
READ_WORKERS: Final = 4


async def _reshard(
    cfg: Config,
    fs: Fs,
    offload: Offload,
    clock: WallClock,
    engine: Engine,
    result: RecoveryResult,
) -> tuple[list[tuple[int, int]], int]:
    """Switch to `result.reshard_to` shards: snapshot everything recovery rebuilt under the
    new layout (replay will start at the beginning of fresh files), then remove every WAL
    file of the old layout. A crash in between is safe: recovery loads the new snapshot
    and skips (then removes) files whose header names the old shard count."""
    assert result.reshard_to is not None
    count = result.reshard_to
    positions = [(0, 0)] * count
    number = result.snapshot_number + 1
    cap = snapshot.capture(engine, positions, clock.now_ms(), segments=result.segments)
    data = await offload.run(snapshot.encode, cap, group="snapshot")
    with trio.CancelScope(shield=True):
        await offload.run(
            snapshot.write_snapshot,
            fs,
            cfg.storage.data_dir,
            number,
            data,
            cfg.storage.snapshot.keep,
            group="snapshot",
        )
        removed = await offload.run(retire_wal, fs, cfg.storage.data_dir, group="snapshot")
    log.warning("re-sharded to %d WAL shards (%d old WAL files removed)", count, removed)
    return positions, number


def _repair(fs: Fs, root: str, result: RecoveryResult) -> None:
    """Recovery succeeded: cut segment bytes past their registered lengths and remove
    segment files no registry names (recovery itself never writes)."""
    segs.repair(fs, root, result.segment_truncate, result.segment_orphans, result.segment_metas)


@asynccontextmanager
async def open_durable_engine(
    cfg: Config,
    fs: Fs,
    offload: Offload,
    clock: WallClock,
    *,
    boot_id: str | None,
    progress: Callable[[float], None] = lambda _: None,
    recover_in_thread: bool = True,
    on_recovered: Callable[[RecoveryResult], None] | None = None,
) -> AsyncIterator[Engine]:
    """Recover `cfg.storage.data_dir` and run an engine on its WAL (see module docstring).

    Raises `RecoveryRefused` (nothing modified) when the directory cannot be vouched for.
    """
    root = cfg.storage.data_dir
    t0 = trio.current_time()
    if recover_in_thread:
        result = await trio.to_thread.run_sync(
            lambda: recover(
                cfg, fs, clock, boot_id=boot_id, progress=progress, read_workers=READ_WORKERS
            )
        )
        await trio.to_thread.run_sync(_repair, fs, root, result)
        await trio.to_thread.run_sync(prepare_data_dir, fs, root)
    else:
        result = recover(cfg, fs, clock, boot_id=boot_id, progress=progress)
        _repair(fs, root, result)
        prepare_data_dir(fs, root)
        await trio.lowlevel.checkpoint()
    engine = result.engine
    engine.recovery = {
        "duration_ms": (trio.current_time() - t0) * 1000,
        "lost_tail_seqs": sum(n.gap_to - n.gap_from + 1 for n in result.lost),
    }
    log.info(
        "recovered %d topics from %d frames (%d bytes) in %.3f s%s",
        len(engine.topics),
        result.frames,
        result.bytes,
        trio.current_time() - t0,
        f"; torn tails ignored: {', '.join(result.torn)}" if result.torn else "",
    )
    for note in result.lost:
        log.warning(
            "topic %r: seqs %d..%d may have been lost with the unsynced tail at a machine "
            "crash; readers crossing them get a crash tombstone",
            note.topic.name,
            note.gap_from,
            note.gap_to,
        )
    if on_recovered is not None:
        on_recovered(result)
    positions = result.snapshot_positions
    number = result.snapshot_number
    if result.reshard_to is not None:
        positions, number = await _reshard(cfg, fs, offload, clock, engine, result)
        result.shard_files = [ShardFiles() for _ in range(result.reshard_to)]
    wal = WalCommitPath(cfg, fs, offload, clock, root, result.shard_files)
    engine.commit = wal
    wal.attach(engine)
    checkpointer = Checkpointer(
        cfg, engine, wal, fs, offload, clock, number, positions, result.segments
    )
    engine.checkpointer = checkpointer
    wal.checkpointer = checkpointer
    wal.register_queues(engine.saturation)
    async with trio.open_nursery() as nursery:
        await nursery.start(wal.run)
        for note in result.lost:  # sync-gated, before the topic serves again
            mark = frames.encode_control(
                frames.LOST_RANGE,
                note.topic.topic_id,
                clock.now_ms(),
                {"gap_from": note.gap_from, "gap_to": note.gap_to},
            )
            await wal.control(note.topic, mark, lambda: None)
        # re-anchor every router at its recovered cursor and its destination's head
        # (which recovery may have raised), so the next recovery places later copies right
        await engine.routers.log_cursors(sync=True)
        await offload.run(record_boot, fs, root, boot_id, group="misc")
        await nursery.start(engine.run)
        await nursery.start(checkpointer.run)
        try:
            yield engine
        finally:
            engine.closed = True
            with (
                trio.CancelScope(shield=True),
                trio.move_on_after(cfg.storage.snapshot.final_timeout_ms / 1000) as bound,
            ):
                await wal.close()
                # every accepted write is committed and synced: a final snapshot releases
                # the seq reservations, so a clean restart resumes with no gap
                await checkpointer.checkpoint(final=True)
            if bound.cancelled_caught:
                log.error("the final drain did not finish in time; recovery will replay")
            nursery.cancel_scope.cancel("storage closed")
