"""`topicd write`, `topicd tail` and `topicd topics`, end to end.

Method: a real server runs in this process (`serve_in_process`, port 0); the command runs
as a real child (`python -m topicd ...`) with an environment stripped of every
`TOPICD_*` variable except the ones a test sets, so the developer's shell never leaks in.
Outputs are compared exactly (stdout lines, stderr lines, exit codes); server state is
read back with the client. `tail -f` is read line by line from the child's pipe, and
stopped with SIGINT, its normal end.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from contextlib import asynccontextmanager

import msgspec
import pytest
import trio

from tests.server.helpers import served
from topicd.client import Client
from topicd.testing.harness import make_config

TOPICD = [sys.executable, "-m", "topicd"]
# `topicd` with SIGINT at its default action: a command a non-interactive shell starts in
# the background (`bash .ci/run &`) inherits SIGINT ignored, every child too, and Python
# then installs no KeyboardInterrupt handler, so `tail -f` would rightly ignore it
DEFAULT_SIGINT = [
    sys.executable,
    "-c",
    "import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); "
    "os.execv(sys.executable, [sys.executable, '-m', 'topicd', *sys.argv[1:]])",
]

pytestmark = pytest.mark.slow


def env(**extra):
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("TOPICD_", "TOPICS_"))}
    return clean | extra


@asynccontextmanager
async def server(**sections):
    async with served(make_config(server={"port": 0}, **sections)) as (_e, _a, host, port):
        url = f"http://{host}:{port}"
        async with Client(url) as c:
            yield url, c


async def cli(args, url=None, stdin=b"", **extra_env):
    e = env(**extra_env)
    if url is not None:
        e["TOPICD_URL"] = url
    with trio.fail_after(30):
        proc = await trio.run_process(
            [*TOPICD, *args],
            stdin=stdin,
            capture_stdout=True,
            capture_stderr=True,
            env=e,
            check=False,
        )
    return proc.returncode, proc.stdout.decode(), proc.stderr.decode()


async def test_write_batches_stdin_lines_and_keeps_payloads_exact():
    async with server() as (url, c):
        lines = [
            b'{"data":{"celsius":21.40,"n":123456789012345678901234567890},"tag":"a","meta":{"m":1.0}}'
        ]
        lines += [msgspec.json.encode({"data": i}) for i in range(2, 2501)]
        stdin = b"\n".join(lines) + b"\n\n"  # a trailing blank line is skipped
        code, out, err = await cli(["write", "w", "--batch", "1000"], url, stdin)
        assert (code, err) == (0, "")
        assert msgspec.json.decode(out) == {
            "topic": "w",
            "records": 2500,
            "batches": 3,
            "first_seq": 1,
            "last_seq": 2500,
        }
        first = await c.diff("w", include_tags=True, limit=1).__anext__()
        assert first.data_json == b'{"celsius":21.40,"n":123456789012345678901234567890}'
        assert (first.tag, first.meta_json) == ("a", b'{"m":1.0}')
        assert (await c.get_topic("w"))["count"] == 2500


async def test_write_stops_at_a_bad_line_after_writing_what_came_before():
    async with server() as (url, c):
        stdin = b'{"data":1}\n{"data":2}\n{"tag":"no data"}\n{"data":4}\n'
        code, out, err = await cli(["write", "w"], url, stdin)
        assert code == 2
        assert err.startswith("topicd: invalid_input: line 3: not a record object")
        assert msgspec.json.decode(out)["records"] == 2
        assert [e.data async for e in c.diff("w")] == [1, 2]
        code, _, err = await cli(["write", "w"], url, b"not json\n")
        assert code == 2 and "line 1: not JSON" in err


async def test_topics_lists_every_topic_with_counts():
    async with server() as (url, c):
        await c.write_batch("beta", [{"data": 1}, {"data": 2}])
        await c.put_topic("alpha")
        code, out, err = await cli(["topics"], url)
        assert (code, err) == (0, "")
        assert out.splitlines() == [
            "TOPIC  COUNT  BYTES  HEAD_SEQ  EARLIEST_SEQ",
            "alpha      0      0         0             1",
            "beta       2      2         2             1",
        ]
        code, out, _ = await cli(["topics", "--json", "--prefix", "b"], url)
        assert [msgspec.json.decode(x)["count"] for x in out.splitlines()] == [2]


async def test_tail_prints_records_and_sends_tombstones_to_stderr():
    async with server() as (url, c):
        await c.put_topic("capped", {"cap_records": 2})
        await c.write_batch("capped", [{"data": i, "tag": f"t{i}"} for i in range(1, 5)])
        await c.write("plain", msgspec.Raw(b'{"x":1.50}'))
        code, out, err = await cli(["tail", "capped", "plain"], url)
        assert code == 0
        lines = [msgspec.json.decode(x) for x in out.splitlines()]
        assert [(x["topic"], x["$seq"], x["data"], x.get("$tag")) for x in lines] == [
            ("capped", 3, 3, "t3"),
            ("capped", 4, 4, "t4"),
            ("plain", 1, {"x": 1.5}, None),
        ]
        assert '"x":1.50' in out.splitlines()[2]  # the payload text, exactly
        assert [msgspec.json.decode(x) for x in err.splitlines()] == [
            {
                "topic": "capped",
                "tombstone": {
                    "reason": "cap",
                    "gap_from": 1,
                    "gap_to": 2,
                    "earliest_seq": 3,
                    "head_seq": 4,
                },
            }
        ]
        code, out, _ = await cli(["tail", "--from-seq", "3", "capped"], url)
        assert [msgspec.json.decode(x)["$seq"] for x in out.splitlines()] == [4]


async def test_tail_follow_prints_new_records_until_interrupted():
    async with server() as (url, c):
        await c.write_batch("f", [{"data": 1}, {"data": 2}])
        await c.write("g", "g1")
        proc = await trio.lowlevel.open_process(
            [*DEFAULT_SIGINT, "tail", "-f", "f", "g"],
            # (faulthandler: a SIGABRT after a hang prints every thread's stack)
            env=env(TOPICD_URL=url, PYTHONFAULTHANDLER="1"),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            stdin=subprocess.DEVNULL,
        )
        buf = b""
        err = bytearray()

        async def line():
            nonlocal buf
            while b"\n" not in buf:
                chunk = await proc.stdout.receive_some(65536)
                assert chunk, "tail -f ended"
                buf += chunk
            first, buf = buf.split(b"\n", 1)
            return msgspec.json.decode(first)

        async def drain_stderr() -> None:
            # (read all along: a full pipe would block the process, and a failure shows it)
            while chunk := await proc.stderr.receive_some(65536):
                err.extend(chunk)

        try:
            with trio.fail_after(20):
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(drain_stderr)
                    assert [(await line())["$seq"] for _ in range(3)] == [1, 2, 1]
                    await c.write("f", 3)
                    got = await line()
                    assert (got["topic"], got["$seq"], got["data"]) == ("f", 3, 3)
                    await c.write("g", "g2")
                    got = await line()
                    assert (got["topic"], got["$seq"]) == ("g", 2)
                    proc.send_signal(signal.SIGINT)
                    assert await proc.wait() == 0, err.decode(errors="replace")
        except trio.TooSlowError:
            status = await trio.Path(f"/proc/{proc.pid}/status").read_text()
            err.extend(  # (which signals it ignores, blocks, catches)
                "".join(x for x in status.splitlines(True) if x.startswith("Sig")).encode()
            )
            proc.send_signal(signal.SIGABRT)  # the stacks of the hang, then its stderr's end
            with trio.move_on_after(5):
                while chunk := await proc.stderr.receive_some(65536):
                    err.extend(chunk)
            raise AssertionError(f"tail -f: no exit 20 s in; stderr:\n{err.decode()}") from None
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()


async def test_failures_print_code_and_message_and_exit_1():
    async with server() as (url, _c):
        code, out, err = await cli(["tail", "nope"], url)
        assert (code, out) == (1, "")
        assert err == "topicd: topic_not_found: topic 'nope' does not exist\n"
    # a port nobody listens on: the retries run out
    code, _, err = await cli(["topics", "--url", "http://127.0.0.1:9", "--retries", "1"])
    assert code == 1 and err.startswith("topicd: connection_failed: ")


async def test_a_refused_write_exits_1_with_the_server_code():
    async with server() as (url, c):
        await c.put_topic("full", {"cap_records": 2, "discard": "reject"})
        await c.write("full", 0)
        code, out, err = await cli(["write", "full"], url, b'{"data":1}\n{"data":2}\n')
        assert (code, out) == (1, "")
        assert err.startswith("topicd: topic_full: "), err
        assert (await c.get_topic("full"))["count"] == 1  # one batch, refused whole


async def test_usage_errors_exit_2():
    code, _, err = await cli(["tail"])
    assert code == 2 and "the following arguments are required: TOPIC" in err
    code, _, err = await cli(["write", "t", "--batch", "0"], stdin=b"")
    assert code == 2 and "--batch must be at least 1" in err


async def test_token_from_the_flag_or_the_environment():
    async with server(auth={"api_keys": ("k1",)}) as (url, _c):
        code, _, err = await cli(["topics"], url)
        assert code == 1 and err.startswith("topicd: unauthorized: ")
        code, _, err = await cli(["write", "t"], url, b'{"data":1}\n', TOPICD_TOKEN="k1")
        assert (code, err) == (0, "")
        code, out, _ = await cli(["topics", "--token", "k1"], url)
        assert code == 0 and "t " in out.splitlines()[1] + " "
