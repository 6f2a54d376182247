"""`docs/openapi.yaml` as a test oracle: which operations it documents, and whether an
answer (status, headers, body) is one it allows.

Bodies are checked with `jsonschema` (Draft 2020-12, the dialect of OpenAPI 3.1) against
the document itself, `$ref`s resolved through a `referencing` registry. Checks are
**strict** by default: every object schema that lists `properties` and says nothing
about other keys is read as closed, so a field the server sends but the document lacks
fails a check (clients must tolerate unknown keys, so the document itself stays open;
the strictness keeps it complete).

Used by the contract test (`tests/http/test_openapi.py`), the property-based fuzzing
from the document (`tests/http/test_openapi_fuzz.py`) and `bench/fuzz_api.py`.
"""

from __future__ import annotations

import copy
import gzip
import re
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Final, cast

import orjson
import yaml
from jsonschema import Draft202012Validator
from referencing import Registry, Resource
from referencing.jsonschema import DRAFT202012

if TYPE_CHECKING:
    from collections.abc import Iterator, Mapping

    from quart_trio import QuartTrio

DOC_PATH: Final = Path(__file__).resolve().parents[2] / "docs" / "openapi.yaml"
BASE_URI: Final = "urn:topicd:openapi"
METHODS: Final = ("get", "put", "post", "delete", "patch", "head", "options")
# headers an answer may carry only where the document lists them (the others it does not
# list, e.g. `content-length` or `date`, are the transport's)
UNLESS_DOCUMENTED: Final = ("content-encoding", "vary", "retry-after", "www-authenticate")

Json = dict[str, object]


def load_document(path: Path = DOC_PATH) -> Json:
    doc = yaml.safe_load(path.read_text("utf-8"))
    assert isinstance(doc, dict)
    return doc


def _escape(token: str) -> str:
    return token.replace("~", "~0").replace("/", "~1")


def closed(doc: Json) -> Json:
    """A copy of `doc` in which every object schema listing `properties` without an
    `additionalProperties` / `unevaluatedProperties` of its own admits no other keys."""
    out = copy.deepcopy(doc)

    def walk(node: object) -> None:
        if isinstance(node, dict):
            if (
                node.get("type") == "object"
                and "properties" in node
                and "additionalProperties" not in node
                and "unevaluatedProperties" not in node
            ):
                node["additionalProperties"] = False
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(out)
    return out


@dataclass(frozen=True)
class Operation:
    method: str  # upper case
    path: str  # the document's template, e.g. /v0/topics/{topic}
    pointer: str  # JSON pointer of the operation object (after path-item $refs)
    spec: Json

    @property
    def key(self) -> tuple[str, str]:
        return self.method, self.path

    @property
    def statuses(self) -> set[str]:
        return set(cast("Json", self.spec["responses"]))

    @cached_property
    def regex(self) -> re.Pattern[str]:
        parts = re.split(r"(\{[^}]+\})", self.path)
        pattern = "".join("[^/]+" if p.startswith("{") else re.escape(p) for p in parts)
        return re.compile(f"^{pattern}$")


class Contract:
    """The document's operations and an answer checker (see the module docstring)."""

    def __init__(self, doc: Json | None = None, *, strict: bool = True) -> None:
        self.doc = doc if doc is not None else load_document()
        self.checked = closed(self.doc) if strict else self.doc
        resource = Resource.from_contents(self.checked, default_specification=DRAFT202012)
        self.registry: Registry[object] = Registry().with_resource(BASE_URI, resource)
        self.operations = list(self._operations())
        self._validators: dict[str, Draft202012Validator] = {}

    # ---- the document -----------------------------------------------------------------

    def resolve(self, node: object, pointer: str) -> tuple[Json, str]:
        """(`node` with a local `$ref` followed, the pointer it lives at)."""
        assert isinstance(node, dict)
        while _ref_only(node):
            ref = cast("str", node["$ref"])
            assert ref.startswith("#/"), ref
            pointer = ref[1:]
            node = cast("Json", self.at(pointer))
        return node, pointer

    def at(self, pointer: str, doc: Json | None = None) -> object:
        node: object = self.doc if doc is None else doc
        for raw in pointer.lstrip("/").split("/"):
            token = raw.replace("~1", "/").replace("~0", "~")
            node = cast("dict[str, object]", node)[token]
        return node

    def _operations(self) -> Iterator[Operation]:
        for path, raw in cast("Json", self.doc["paths"]).items():
            item, base = self.resolve(raw, "/paths/" + _escape(path))
            for method, op in item.items():
                if method not in METHODS:
                    continue
                spec, pointer = self.resolve(op, f"{base}/{method}")
                yield Operation(method.upper(), path, pointer, spec)

    def operation(self, method: str, path: str) -> Operation:
        """The operation `method path` (a template or a concrete path)."""
        method = method.upper()
        for op in self.operations:
            if op.method == method and op.path == path:
                return op
        found = [op for op in self.operations if op.method == method and op.regex.match(path)]
        # a literal path beats a template (`/v0/topics` vs `/v0/topics/{topic}` never clash,
        # but keep the rule explicit): the one with the fewest parameters
        found.sort(key=lambda op: op.path.count("{"))
        if not found:
            raise KeyError(f"the document has no operation {method} {path}")
        return found[0]

    def validator(self, pointer: str) -> Draft202012Validator:
        v = self._validators.get(pointer)
        if v is None:
            v = Draft202012Validator({"$ref": f"{BASE_URI}#{pointer}"}, registry=self.registry)
            self._validators[pointer] = v
        return v

    # ---- answers ----------------------------------------------------------------------

    def problems(
        self,
        method: str,
        path: str,
        status: int,
        headers: Mapping[str, str],
        body: bytes,
        *,
        streaming: bool = False,
    ) -> list[str]:
        """What is wrong with an answer of `method path` (empty: it conforms).

        `headers` are looked up case-insensitively; `body` is the raw body as received
        (gzip is undone here when `Content-Encoding` says so). With `streaming` the body
        is the start of an unbounded stream and only the status and headers are checked.
        """
        op = self.operation(method, path)
        where = f"{method} {path} -> {status}"
        raw = op.spec["responses"]
        assert isinstance(raw, dict)
        if str(status) not in raw:
            return [f"{where}: status not documented (documented: {sorted(raw)})"]
        response, rpointer = self.resolve(raw[str(status)], f"{op.pointer}/responses/{status}")
        lower = {k.lower(): v for k, v in headers.items()}
        out: list[str] = []
        documented = {name.lower() for name in cast("Json", response.get("headers", {}))}
        out.extend(
            f"{where}: header {name} sent but not documented for this answer"
            for name in UNLESS_DOCUMENTED
            if name in lower and name not in documented
        )
        for name, hdr in cast("Json", response.get("headers", {})).items():
            spec, _ = self.resolve(hdr, "")
            value = lower.get(name.lower())
            if value is None:
                if spec.get("required"):
                    out.append(f"{where}: header {name} missing")
                continue
            schema = cast("Json", spec.get("schema", {}))
            out.extend(
                f"{where}: header {name}: {value!r}: {err.message}"
                for err in Draft202012Validator(schema).iter_errors(value)
            )
        content = cast("Json", response.get("content", {}))
        if not content:
            if body and not streaming:
                out.append(f"{where}: a body where the document has none")
            return out
        ctype = lower.get("content-type", "")
        key = _media_key(content, ctype)
        if key is None:
            return [*out, f"{where}: content type {ctype!r} not documented ({sorted(content)})"]
        if streaming:
            return out
        if lower.get("content-encoding") == "gzip":
            body = gzip.decompress(body)
        elif "content-encoding" in lower:
            out.append(f"{where}: unexpected content-encoding {lower['content-encoding']!r}")
            return out
        if not key.startswith("application/json"):
            try:
                body.decode("utf-8")
            except UnicodeDecodeError:
                out.append(f"{where}: a text body that is not UTF-8")
            return out
        try:
            value = orjson.loads(body)
        except orjson.JSONDecodeError as exc:
            return [*out, f"{where}: body is not JSON ({exc}): {body[:200]!r}"]
        pointer = f"{rpointer}/content/{_escape(key)}/schema"
        for err in self.validator(pointer).iter_errors(value):
            path_s = "/".join(map(str, err.absolute_path))
            out.append(f"{where}: body at /{path_s}: {err.message[:300]}")
        return out

    def request_schema(self, op: Operation) -> Json | None:
        """The operation's JSON request-body schema with every `$ref` inlined (for
        generators that cannot follow references), or None without a body."""
        body = op.spec.get("requestBody")
        if body is None:
            return None
        spec, _ = self.resolve(body, "")
        schema = cast("Json", cast("Json", spec["content"])["application/json"])["schema"]
        return cast("Json", self.inline(schema))

    def inline(self, node: object) -> object:
        """`node` with every local `$ref` replaced by its target (siblings kept through
        `allOf`); the document has no recursive references."""
        if isinstance(node, list):
            return [self.inline(v) for v in node]
        if not isinstance(node, dict):
            return node
        out = {k: self.inline(v) for k, v in node.items() if k != "$ref"}
        if "$ref" in node:
            target = self.inline(self.at(cast("str", node["$ref"])[1:]))
            return {"allOf": [target, out]} if out else target
        return out

    def served(self, app: QuartTrio) -> set[tuple[str, str]]:
        """(METHOD, template) of every route `app` serves, in the document's spelling."""
        out: set[tuple[str, str]] = set()
        for rule in app.url_map.iter_rules():
            if rule.endpoint == "static":
                continue
            path = re.sub(r"<(?:\w+:)?(\w+)>", r"{\1}", rule.rule)
            for method in (rule.methods or set()) - {"HEAD", "OPTIONS"}:
                out.add((method, path))
        return out


def _ref_only(node: Json) -> bool:
    return set(node) == {"$ref"}


def _media_key(content: Json, ctype: str) -> str | None:
    """The document's content key for a response `Content-Type`: the media type must
    match (case-insensitive) and so must every parameter the document names."""
    got_type, *got_params = [p.strip() for p in ctype.split(";")]
    got = dict(p.split("=", 1) for p in got_params if "=" in p)
    for key in content:
        want_type, *want_params = [p.strip() for p in key.split(";")]
        if want_type.lower() != got_type.lower():
            continue
        want = dict(p.split("=", 1) for p in want_params if "=" in p)
        if all(got.get(k) == v for k, v in want.items()):
            return key
    return None
