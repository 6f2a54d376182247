#!/usr/bin/env python
"""What one fan-out costs the server per watcher, against the socket limit, in process.

    python bench/fanout_cost.py [--watchers 1000] [--events 200] [--rounds 5] [--no-pin]
                                [--no-syscall]

No HTTP: an engine (`open_engine`, an `ephemeral` topic) with N watch streams whose
transports are real loopback TCP sockets, each parked live at the head as a stream on
the direct socket path is between events (no pump runs: every frame reaches the socket
through the drain). A reader process (on the other CPU with two or more) holds the other
ends and discards what arrives, as fast as it can. Each event is one single-record
`append`; the time is the loop's CPU time from the append until the drain has written to
every socket, per (watcher, event). The governor's coalescing is off
(`governor.coalesce_above = 1`), so every event is drained at once, alone. Three ways,
alternated round by round:

* `batch`: the drain's shared batch, one non-blocking `send` per parked stream
  (`Conn.push` on a stream that has `sock`, as the direct path sets it);
* `offer`: the frame-by-frame path (`Conn.offer` → `_write_now` → the transport's
  `direct` writer, which frames the chunk and sends it), what a stream without `sock`
  gets, and what every stream got before the shared batches;
* `floor`: a bare loop of `socket.send` of one pre-built chunk over the same sockets:
  the socket limit, no topicd code at all.

Socket send buffers are large (4 MiB), so no send is partial: a partial send would hand
the rest to a pump that does not exist here, and the script fails instead of measuring
it. Prints µs per (watcher, event) for each way (median of rounds) and the ratios to the
floor. With `--no-syscall` every socket is a stand-in whose `send` takes everything
without a system call: what is left is the Python work per watcher.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import msgspec
import orjson
import trio
import trio.testing

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from topicd.clock import SystemWallClock
from topicd.engine.engine import open_engine
from topicd.engine.watch import LIVE, Conn
from topicd.testing.harness import make_config
from topicd.wire import RecordIn, TopicConfigIn, WatchIn, WatchTopicIn, WriteIn

READER = r"""
import selectors, socket, sys
port, n = int(sys.argv[1]), int(sys.argv[2])
socks = [socket.create_connection(("127.0.0.1", port)) for _ in range(n)]
sel = selectors.DefaultSelector()
for s in socks:
    s.setblocking(False)
    sel.register(s, selectors.EVENT_READ)
print("ready", flush=True)
while True:
    for key, _ in sel.select():
        try:
            if not key.fileobj.recv(1 << 20):
                sys.exit(0)
        except BlockingIOError:
            pass
"""

SNDBUF = 4 << 20


class NoSyscall:
    """A socket stand-in that takes every byte without a system call."""

    def send(self, data: bytes, /) -> int:
        return len(data)


def chunk_writer(sock: socket.socket | NoSyscall):
    """What the direct path's `try_write` does: frame one chunk, send without blocking."""

    def direct(payload: bytes) -> bytes | None:
        data = b"%x\r\n" % len(payload) + payload + b"\r\n"
        try:
            sent = sock.send(data)
        except BlockingIOError:
            sent = 0
        except OSError:
            return None
        return data[sent:]

    return direct


async def run(args: argparse.Namespace) -> dict[str, list[float]]:
    n = args.watchers
    listener = socket.create_server(("127.0.0.1", 0), backlog=n)
    port = listener.getsockname()[1]
    reader = subprocess.Popen(
        [sys.executable, "-c", READER, str(port), str(n)],
        stdout=subprocess.PIPE,
    )
    if args.pin:
        os.sched_setaffinity(reader.pid, {1})
    socks = []
    for _ in range(n):
        s, _ = listener.accept()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SNDBUF)
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        s.setblocking(False)
        socks.append(s)
    assert reader.stdout is not None
    assert reader.stdout.readline().strip() == b"ready"
    out: dict[str, list[float]] = {"batch": [], "offer": [], "floor": []}
    targets: list[socket.socket | NoSyscall] = (
        [NoSyscall() for _ in socks] if args.no_syscall else list(socks)
    )
    try:
        # no coalescing: this measures one drain per event, whatever the governor reads
        cfg = make_config(governor={"coalesce_above": 1.0})
        async with open_engine(cfg, SystemWallClock()) as engine:
            await engine.put_topic("t", msgspec.convert({"durability": "ephemeral"}, TopicConfigIn))
            conns: list[Conn] = []
            for s in targets:
                req = WatchIn(topics={"t": WatchTopicIn(tail=True)})
                session, _ = engine.create_watch(None, req, False)
                conn = engine.watch.open_stream(session, None)
                conn.mode["t"] = LIVE
                conn.enqueued_to["t"] = conn.pos["t"]
                conn.direct = chunk_writer(s)
                conns.append(conn)
            payload = orjson.dumps("x" * 98)
            chunk = b"%x\r\n" % 180 + b"y" * 180 + b"\r\n"
            for r in range(args.rounds):
                ways = ["batch", "offer", "floor"]
                shift = r % 3
                for way in ways[shift:] + ways[:shift]:
                    for conn, s in zip(conns, targets, strict=True):
                        conn.sock = s if way == "batch" else None
                        conn.park()  # what the pump does before it waits
                    t0 = time.process_time()
                    for _ in range(args.events):
                        if way == "floor":
                            for s in targets:
                                if s.send(chunk) != len(chunk):
                                    raise SystemExit("a partial send: raise SNDBUF")
                        else:
                            await engine.append("t", WriteIn(records=[RecordIn(data=payload)]))
                            await trio.testing.wait_all_tasks_blocked()
                            topic = engine.topics["t"]
                            if topic.drained_to != topic.head_seq:
                                raise SystemExit("the drain did not run at once")
                    spent = time.process_time() - t0
                    for conn in conns:
                        if conn.remainder or conn.lagged:
                            raise SystemExit("a partial send: raise SNDBUF")
                    out[way].append(1e6 * spent / (n * args.events))
                    await trio.sleep(0.2)  # the reader catches up
            for conn in conns:
                engine.watch.close(conn)
    finally:
        for s in socks:
            s.close()
        reader.wait(10)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--watchers", type=int, default=1000)
    p.add_argument("--events", type=int, default=200)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--no-pin", action="store_true", help="do not pin (this: CPU 0, reader: 1)")
    p.add_argument(
        "--no-syscall", action="store_true", help="sockets that take everything, no syscall"
    )
    args = p.parse_args()
    args.pin = not args.no_pin and len(os.sched_getaffinity(0)) >= 2
    if args.pin:
        os.sched_setaffinity(0, {0})
    res = trio.run(run, args)
    print(
        f"watchers {args.watchers}, events {args.events}, rounds {args.rounds}, pin {args.pin}, "
        f"syscalls {not args.no_syscall}"
    )
    print(f"loadavg at end: {' '.join(Path('/proc/loadavg').read_text().split()[:3])}")
    floor = statistics.median(res["floor"])
    for way, values in res.items():
        med = statistics.median(values)
        rounds = " ".join(f"{v:.2f}" for v in values)
        print(
            f"{way:<6} {med:6.2f} µs per watcher per event ({med / floor:.2f}× floor)  [{rounds}]"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
