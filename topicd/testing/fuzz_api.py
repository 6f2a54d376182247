"""Property-based requests generated from docs/openapi.yaml, run against the in-process
app: the driver shared by the CI test (`tests/http/test_openapi_fuzz.py`, a short
budget) and `bench/fuzz_api.py` (a long one).

For every documented operation (except the two SSE streams and the WebSocket upgrade,
which do not end by themselves) Hypothesis draws requests: path names from a few that
exist and from the document's name patterns, query parameters from their schemas or as
arbitrary text, and a body that is valid for the operation's request schema (through
`hypothesis-jsonschema`), arbitrary JSON, empty, or sent without the JSON content type;
sometimes with `Accept-Encoding: gzip`. Each answer must hold the invariants:

* no 5xx except a `503` the document lists for the operation;
* the answer conforms to the document (`Contract.problems`: status listed, headers,
  body schema, strictly);
* nothing logged a traceback.
"""

from __future__ import annotations

import errno
import json
import logging
from typing import TYPE_CHECKING, Final, TypeAlias, cast
from urllib.parse import quote, urlencode

import trio
from hypothesis import strategies as st

from topicd.testing.fake_fs import FakeDisk, FaultFs
from topicd.testing.harness import durable_config, open_app, open_durable_app
from topicd.testing.openapi import Contract, Operation

if TYPE_CHECKING:
    from collections import Counter
    from collections.abc import Awaitable, Callable

    from hypothesis.strategies import SearchStrategy

    # (method, path with query, headers, body) -> (status, headers, raw body as received)
    Send: TypeAlias = Callable[
        [str, str, dict[str, str], bytes], Awaitable[tuple[int, dict[str, str], bytes]]
    ]

SKIPPED: Final = frozenset(
    {("GET", "/v0/topics/{topic}/work"), ("GET", "/v0/watch/{wid}"), ("GET", "/v0/ws")}
)
TOPICS: Final = ("t", "q", "d", "nope", "x.y:z-1")

ROUTERS: Final = ("t->d", "d->t", "a->b")
WAITS_S: Final = (0.05, 0.5, 2.0, 30.0)  # virtual seconds between requests (fault mode)
# fault mode: short breaker times, so a healed shard is back within RECOVERY_S
FAULT_BREAKER: Final[dict[str, object]] = {"open_ms": 200, "max_open_ms": 2000}
RECOVERY_S: Final = 2.0  # `max_open_ms`: the longest a healed shard stays open


_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)


def from_schema(schema: object) -> SearchStrategy[object]:
    """Values valid for the subset of JSON Schema the document's request bodies use
    (`type`, `properties`/`required`, `items` with `minItems`/`maxItems`, `pattern`,
    `minimum`/`maximum`, `enum`, `const`, `oneOf`/`anyOf`/`allOf`, `propertyNames`,
    `additionalProperties`, `minLength`). hypothesis-jsonschema would do this, but its
    current release relies on Hypothesis internals that Hypothesis 6.1xx removed."""
    if schema is True or schema == {} or not isinstance(schema, dict):
        return _json
    s = cast("dict[str, object]", schema)
    if "const" in s:
        return st.just(s["const"])
    if "enum" in s:
        return st.sampled_from(cast("list[object]", s["enum"]))
    for key in ("oneOf", "anyOf"):
        if key in s:
            base = {k: v for k, v in s.items() if k != key}
            return st.one_of(
                [
                    from_schema({**base, **cast("dict[str, object]", alt)})
                    for alt in cast("list[object]", s[key])
                ]
            )
    if "allOf" in s:
        merged: dict[str, object] = {k: v for k, v in s.items() if k != "allOf"}
        for part in cast("list[dict[str, object]]", s["allOf"]):
            for k, v in part.items():
                if k == "required":
                    merged["required"] = [
                        *cast("list[str]", merged.get("required", [])),
                        *cast("list[str]", v),
                    ]
                else:
                    merged.setdefault(k, v)
        return from_schema(merged)
    kind = s.get("type")
    if isinstance(kind, list):
        return st.one_of([from_schema({**s, "type": k}) for k in kind])
    if kind == "null":
        return st.none()
    if kind == "boolean":
        return st.booleans()
    if kind == "integer":
        lo = cast("int | None", s.get("minimum"))
        hi = cast("int | None", s.get("maximum"))
        edges = [v for v in (lo, hi) if v is not None]
        return st.integers(lo, hi) | st.sampled_from(edges) if edges else st.integers(lo, hi)
    if kind == "number":
        return st.floats(allow_nan=False, allow_infinity=False)
    if kind == "string":
        if "pattern" in s:
            return st.from_regex(cast("str", s["pattern"]), fullmatch=True)
        return st.text(min_size=cast("int", s.get("minLength", 0)), max_size=20)
    if kind == "array":
        return st.lists(
            from_schema(s.get("items", {})),
            min_size=cast("int", s.get("minItems", 0)),
            max_size=min(cast("int", s.get("maxItems", 8)), 8),
        )
    if kind == "object" or "properties" in s:
        props = cast("dict[str, object]", s.get("properties", {}))
        required = set(cast("list[str]", s.get("required", [])))
        fixed = st.fixed_dictionaries(
            {k: from_schema(v) for k, v in props.items() if k in required},
            optional={k: from_schema(v) for k, v in props.items() if k not in required},
        )
        extra = s.get("additionalProperties")
        if isinstance(extra, dict):
            names = from_schema(s.get("propertyNames", {"type": "string"}))
            lo = cast("int", s.get("minProperties", 0))
            hi = min(cast("int", s.get("maxProperties", 4)), 4)
            more = st.dictionaries(
                cast("SearchStrategy[str]", names), from_schema(extra), min_size=lo, max_size=hi
            )
            return st.tuples(fixed, more).map(lambda pair: {**pair[1], **pair[0]})
        return fixed
    return _json


def _dumps(value: object) -> bytes:
    """JSON text of `value`, integers of any size included (orjson stops at 64 bits)."""
    return json.dumps(value, ensure_ascii=False).encode("utf-8", "surrogatepass")


class Tracebacks(logging.Handler):
    """Collects every log record that carries an exception."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.seen: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.exc_info:
            self.seen.append(f"{record.name}: {record.getMessage()}")


class Fuzzer:
    """Strategies per operation, built once from the document."""

    def __init__(self, contract: Contract | None = None, *, max_wait_ms: int | None = None) -> None:
        """`max_wait_ms` bounds the diff long-polls drawn (against a server on the real
        clock; in process, run under a `MockClock` and the waits cost nothing)."""
        self.contract = contract or Contract()
        self.max_wait_ms = max_wait_ms
        self.ops = [op for op in self.contract.operations if op.key not in SKIPPED]
        self._cache: dict[
            tuple[str, str], SearchStrategy[tuple[str, str, dict[str, str], bytes]]
        ] = {}

    def strategy(self, op: Operation) -> SearchStrategy[tuple[str, str, dict[str, str], bytes]]:
        cached = self._cache.get(op.key)
        if cached is None:
            cached = self._cache[op.key] = self._build(op)
        return cached

    def _param(self, param: dict[str, object]) -> SearchStrategy[str]:
        schema = cast("dict[str, object]", self.contract.inline(param.get("schema", {})))
        name = param["name"]
        generated: SearchStrategy[str] = from_schema(schema).map(str)
        if name == "topic":
            return st.sampled_from(TOPICS) | generated
        if name == "router":
            return st.sampled_from(ROUTERS) | generated
        return generated | st.text(max_size=12)

    def _build(self, op: Operation) -> SearchStrategy[tuple[str, str, dict[str, str], bytes]]:
        params = [
            self.contract.resolve(p, "")[0]
            for p in cast("list[object]", op.spec.get("parameters", []))
        ]
        item = self.contract.resolve(self.contract.at(op.pointer.rsplit("/", 1)[0]), "")[0]
        params += [
            self.contract.resolve(p, "")[0]
            for p in cast("list[object]", item.get("parameters", []))
        ]
        path_params = {str(p["name"]): self._param(p) for p in params if p["in"] == "path"}
        query_params = {str(p["name"]): self._param(p) for p in params if p["in"] == "query"}
        schema = self.contract.request_schema(op)
        if schema is not None and self.max_wait_ms is not None:
            wait = cast("dict[str, dict[str, object]]", schema.get("properties", {})).get("wait_ms")
            if wait is not None:
                wait["maximum"] = self.max_wait_ms
        bodies: SearchStrategy[bytes | None]
        if schema is None:
            bodies = st.none()
        else:
            bodies = st.one_of(
                from_schema(schema).map(_dumps),
                from_schema(schema).map(_dumps),
                _json.map(_dumps),
                st.just(b""),
                st.binary(max_size=16),
            )

        @st.composite
        def request(
            draw: Callable[[SearchStrategy[object]], object],
        ) -> tuple[str, str, dict[str, str], bytes]:
            path = op.path
            for name, strat in path_params.items():
                value = cast("str", draw(strat))
                path = path.replace("{" + name + "}", quote(value, safe="") or "x")
            query = {}
            for name, strat in query_params.items():
                if draw(st.booleans()):
                    query[name] = cast("str", draw(strat))
            if query:
                path += "?" + urlencode(query)
            headers: dict[str, str] = {}
            body = cast("bytes | None", draw(bodies))
            if body is not None and draw(st.integers(0, 9)):
                headers["Content-Type"] = "application/json"  # 1 in 10 goes without
            if draw(st.booleans()):
                headers["Accept-Encoding"] = "gzip"
            return op.method, path, headers, body or b""

        return request()

    async def exercise(
        self,
        draw: Callable[[SearchStrategy[object]], object],
        n: int = 5,
        seen: Counter[tuple[str, str, int]] | None = None,
        *,
        faults: bool = False,
    ) -> None:
        """One example on the in-process app: a fresh app with the `SETUP` state, then
        `n` drawn requests (`seen` counts the answers by operation and status); also
        fails when anything logged a traceback.

        With `faults` the app is durable, on a `FakeDisk` behind a `FaultFs`, and before
        each request a drawn choice may make every sync fail from then on (which opens
        the WAL breaker: the documented `503 storage_unavailable`), heal the disk again,
        write a record to one of the `SETUP` topics (traffic for routers and queues), or
        let virtual time pass so background work (router sweeps, breaker probes,
        checkpoints) runs meanwhile. Run it on a `MockClock` with autojump."""
        catcher = Tracebacks()
        root = logging.getLogger()
        root.addHandler(catcher)
        fs = FaultFs(FakeDisk()) if faults else None
        try:
            opened = (
                open_app()
                if fs is None
                else open_durable_app(fs, durable_config(shards=1, breaker=FAULT_BREAKER))
            )
            async with opened as h:
                client = h.app.test_client()

                async def send(
                    method: str, path: str, headers: dict[str, str], body: bytes
                ) -> tuple[int, dict[str, str], bytes]:
                    if fs is not None:
                        choice = draw(
                            st.sampled_from(("keep", "keep", "fail", "heal", "wait", "write"))
                        )
                        if choice == "write":  # traffic on the state: routers, queues
                            await background_write(cast("str", draw(st.sampled_from("tqd"))))
                        elif choice == "fail":
                            fs.fail("fdatasync", always=True, errno=errno.EIO)
                        elif choice == "heal":
                            fs.clear()
                        elif choice == "wait":  # background work runs: sweeps, probes
                            await trio.sleep(cast("float", draw(st.sampled_from(WAITS_S))))
                    r = await client.open(  # type: ignore[call-arg]  # (json: a sentinel default)
                        path, method=method, headers=headers, data=body
                    )
                    return r.status_code, dict(r.headers.items()), cast("bytes", await r.get_data())

                async def background_write(topic: str) -> None:
                    path = f"/v0/topics/{topic}"
                    r = await client.post(path, json={"records": [{"data": 1}]})
                    raw = cast("bytes", await r.get_data())
                    problems = self.contract.problems(
                        "POST", path, r.status_code, dict(r.headers.items()), raw
                    )
                    assert r.status_code < 500 or r.status_code == 503, raw
                    assert problems == [], problems

                for set_method, set_path, set_body in SETUP:
                    r = await client.open(set_path, method=set_method, json=set_body)
                    assert r.status_code < 300, (set_path, await r.get_data())
                await self.requests(send, draw, n, seen)
                if fs is not None:
                    # liveness: once the disk heals and the breaker's longest open time
                    # has passed, the shard takes writes again (no restart needed)
                    fs.clear()
                    await trio.sleep(2 * RECOVERY_S)
                    r = await client.post("/v0/topics/t", json={"records": [{"data": 1}]})
                    assert r.status_code in (200, 201), await r.get_data()  # (t may be gone)
        finally:
            root.removeHandler(catcher)
        assert catcher.seen == [], catcher.seen

    async def requests(
        self,
        send: Send,
        draw: Callable[[SearchStrategy[object]], object],
        n: int,
        seen: Counter[tuple[str, str, int]] | None = None,
    ) -> None:
        """`n` drawn requests through `send`, each answer checked (module docstring)."""
        for _ in range(n):
            op = cast("Operation", draw(st.sampled_from(self.ops)))
            method, path, headers, body = cast(
                "tuple[str, str, dict[str, str], bytes]", draw(self.strategy(op))
            )
            status, got_headers, raw = await send(method, path, headers, body)
            if seen is not None:
                seen[(method, op.path, status)] += 1
            where = f"{method} {path} {headers} {body[:200]!r} -> {status} {raw[:300]!r}"
            assert status < 500 or (status == 503 and "503" in op.statuses), where
            problems = self.contract.problems(method, op.path, status, got_headers, raw)
            assert problems == [], (where, problems)


SETUP: Final = (
    ("POST", "/v0/topics/t", {"records": [{"data": i, "tag": f"k{i}"} for i in range(5)]}),
    ("PUT", "/v0/topics/q", {"type": "queue"}),
    ("POST", "/v0/topics/q", {"records": [{"data": "job"}] * 5}),
    ("PUT", "/v0/routers/t->d", {"source": "t", "dest": "d"}),
)
