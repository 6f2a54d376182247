"""What response compression costs: gzip time and ratio per body size and level, and a
diff answer's server-side time with and without `Accept-Encoding: gzip`.

    python bench/gzip_cost.py            # about 20 s

Part 1 compresses slices of a realistic diff body (records with tags and small JSON
objects) with `topicd.http.compress.gzip_bytes` (level 1, what topicd uses) and with
level 6 (zlib's default), on the loop thread. Part 2 runs `POST .../diff` on the
in-process app (Quart's test client: no sockets) for 100, 1000 and 5000-record answers
and reports the median handler time, identity against gzip.
"""

from __future__ import annotations

import statistics
import time
import zlib

import orjson
import trio

from topicd.http.compress import GZIP_OFFLOAD_BYTES, gzip_bytes
from topicd.testing.harness import make_config, open_app


def body_of(n: int) -> bytes:
    records = [
        {
            "$seq": i,
            "$ts": 1767225600123 + i,
            "$tag": f"sensor-{i % 7}",
            "data": {"room": f"lab-{i % 13}", "celsius": 19.5 + i % 10, "ok": True},
        }
        for i in range(n)
    ]
    return orjson.dumps({"records": records})


def per_call_us(fn, arg: bytes) -> float:
    n = max(3, 3_000_000 // len(arg))
    t = time.perf_counter()
    for _ in range(n):
        fn(arg)
    return (time.perf_counter() - t) / n * 1e6


def level6(b: bytes) -> bytes:
    c = zlib.compressobj(6, zlib.DEFLATED, 31)
    return c.compress(b) + c.flush()


def part1() -> None:
    big = body_of(40000)
    print("size_bytes  level1_us  level1_ratio  level6_us  level6_ratio")
    for size in (1024, 4096, 16384, 65536, 262144, 1 << 20):
        b = big[:size]
        r1 = len(gzip_bytes(b)) / size
        r6 = len(level6(b)) / size
        print(
            f"{size:>10}  {per_call_us(gzip_bytes, b):>9.1f}  {r1:>12.3f}"
            f"  {per_call_us(level6, b):>9.1f}  {r6:>12.3f}"
        )
    print(f"(bodies of {GZIP_OFFLOAD_BYTES} bytes and more are compressed in a worker thread)")


async def part2() -> None:
    cfg = make_config(protocol={"max_limit": 5000})
    async with open_app(cfg) as h:
        c = h.app.test_client()
        for start in range(0, 5000, 1000):
            await c.post(
                "/v0/topics/t",
                json={
                    "records": [
                        {"data": {"room": f"lab-{i % 13}", "celsius": 19.5 + i % 10}, "tag": "s"}
                        for i in range(start, start + 1000)
                    ]
                },
            )
        print("records  body_bytes  identity_p50_ms  gzip_p50_ms  gzip_bytes")
        for n in (100, 1000, 5000):
            out = {}
            for label, headers in (("identity", {}), ("gzip", {"Accept-Encoding": "gzip"})):
                times, size = [], 0
                for _ in range(60):
                    t = time.perf_counter()
                    r = await c.post(
                        "/v0/topics/t/diff",
                        json={"limit": n, "include_tags": True, "max_batch_bytes": 8 << 20},
                        headers=headers,
                    )
                    data = await r.get_data()
                    times.append((time.perf_counter() - t) * 1e3)
                    size = len(data)
                out[label] = (statistics.median(times), size)
            print(
                f"{n:>7}  {out['identity'][1]:>10}  {out['identity'][0]:>15.3f}"
                f"  {out['gzip'][0]:>11.3f}  {out['gzip'][1]:>10}"
            )


def main() -> None:
    part1()
    trio.run(part2)


if __name__ == "__main__":
    main()
