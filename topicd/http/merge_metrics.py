"""`/v0/metrics` of a deployment: the other processes' figures merged into this one's.

On a storage shared by several processes (the jetstream backend's fronts), a scrape of
any of them answers for the whole deployment (`topicd.http.metrics`, `scope` absent or
`deployment`): it asks every other live process for its own figures (`Engine.peers`),
each counting the topics of the shards the asker assigned it, counts the remaining
shards' topics itself, and merges family by family:

* **Topic figures** (topic and queue counts, live records and bytes, leases in flight,
  every per-topic series): each topic is counted by exactly one process, the one
  answering for its shard (its owner, unless that one did not answer: then the scraped
  process, from what it knows), so the merge adds them up; the per-topic series are
  then capped again at the first 1000 topics by name of the whole deployment.
* **Summed**: every counter and histogram (requests served, streams opened, records
  appended, `429`s, drains: each counts what one process did, so the deployment's
  is the sum; `topics_uptime_ms` excepted), the connection gauges (SSE, `/work` and
  WebSocket connections, lagged connections, watch sessions: each lives on one process),
  the routers (each runs on one process) and a queue's `/work` streams (those attached
  on every process).
* **Queue topics' depth levels** (`topicd_queue_*{queue="jobs.<topic>"}`): the
  process counting the topic's; the other entries of those families (the process's
  own bounded queues) are the scraped process's own, its counters summed.
* **The scraped process's own**: every other gauge. They describe one process (pressure
  and its signals, loop lag, the delivery scheduler, client permits, internal queue
  depths, readiness, uptime, build): a sum would mean nothing, and adding a label per
  process would change the series dashboards match.

An answer that does not have the expected shape is treated as no answer. Pure
functions: the asking and the collecting are `topicd.http.metrics`'s.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Final

from prometheus_client.core import GaugeMetricFamily, Metric

from topicd.engine.queues import LEVEL_PREFIX
from topicd.errors import JsonValue

if TYPE_CHECKING:
    from collections.abc import Iterable, Iterator

PER_TOPIC_MAX: Final = 1000

# gauges that count what each process holds (topics counted once, by the process
# answering for their shard; connections, sessions and routers, each on one process)
SUMMED_GAUGES: Final = frozenset(
    {
        "topics_topics",
        "topics_topics_by_class",
        "topics_routers",
        "topicd_router_cursor_lag",
        "topics_records_live",
        "topics_bytes_live",
        "topics_topic_head_seq",
        "topics_topic_earliest_seq",
        "topics_topic_records_live",
        "topics_topic_bytes_live",
        "topics_topic_queue_ready",
        "topics_topic_queue_in_flight",
        "topicd_queue_ready_by_priority",
        "topics_topic_metrics_truncated",
        "topics_queue_topics",
        "topics_queue_leases_in_flight",
        "topics_sse_connections",
        "topics_watch_sessions",
        "topicd_sse_lagged",
        "topicd_jobs_delayed",
        "topicd_jobs_work_streams",
        "topicd_jobs_last_op_ms",
    }
)
# the bounded queues' gauges: a process's own, except a queue topic's depth level
# (`LEVEL_PREFIX`), which the process counting the topic answers
LEVEL_GAUGES: Final = frozenset(
    {
        "topicd_queue_depth",
        "topicd_queue_capacity",
        "topicd_queue_saturation",
        "topicd_queue_peak",
        "topicd_queue_level",
    }
)
OWN_COUNTERS: Final = frozenset({"topics_uptime_ms"})  # (a process's age, not a count)
WORK_STREAMS: Final = "topicd_jobs_work_streams"
TRUNCATED: Final = "topics_topic_metrics_truncated"
PER_TOPIC_NAMES: Final = "topics_topic_head_seq"  # (every topic counted has a head)

# the JSON snapshot's keys that add up (the rest are the scraped process's own)
JSON_SUMMED: Final = (
    "topics",
    "topics_ephemeral",
    "topics_memory",
    "topics_disk",
    "topics_fsync",
    "routers",
    "records_live",
    "bytes_live",
    "queue_topics",
    "queue_leases_in_flight",
    "sse_connections",
    "watch_sessions",
    "records_appended",
)

Sample = tuple[str, dict[str, str], float]
Families = dict[str, list[JsonValue]]  # family name -> its samples as an answer has them


def summed(family: Metric) -> bool:
    """Whether `family` adds up over the processes (else the scraped one's is kept)."""
    if family.type in ("counter", "histogram"):
        return family.name not in OWN_COUNTERS
    return family.name in SUMMED_GAUGES


def carried(family: Metric) -> bool:
    """Whether an answer carries `family` (what the asker merges of it)."""
    return summed(family) or family.name in LEVEL_GAUGES


def wire_family(family: Metric) -> JsonValue:
    """`family` as an answer carries it: `[name, [[sample name, labels, value], …]]`."""
    samples: list[JsonValue] = []
    for s in family.samples:
        labels: dict[str, JsonValue] = dict(s.labels)
        samples.append([s.name, labels, s.value])
    return [family.name, samples]


def _number(value: object) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value)


def _work(value: object) -> dict[str, int] | None:
    """An answer's `work`: {queue topic: `/work` streams attached there}."""
    if not isinstance(value, dict):
        return None
    out: dict[str, int] = {}
    for name, n in value.items():
        if isinstance(n, bool) or not isinstance(n, int):
            return None
        out[str(name)] = n
    return out


def text_answer(figures: JsonValue) -> tuple[Families, dict[str, int]] | None:
    """A process's figures for the Prometheus form (`{"families": [wire_family…],
    "work": {…}}`), checked down to the families; None when they are not of that shape.
    (Samples are checked as they are merged, a family a loop step: a malformed one is
    left out.)"""
    if not isinstance(figures, dict):
        return None
    raw = figures.get("families")
    work = _work(figures.get("work"))
    if not isinstance(raw, list) or work is None:
        return None
    families: Families = {}
    for entry in raw:
        if not (
            isinstance(entry, list)
            and len(entry) == 2
            and isinstance(entry[0], str)
            and isinstance(entry[1], list)
        ):
            return None
        families[entry[0]] = entry[1]
    return families, work


def samples(families: Families, name: str) -> Iterator[Sample]:
    """The well-formed samples of family `name` in an answer."""
    for s in families.get(name, ()):
        if not (isinstance(s, list) and len(s) == 3 and isinstance(s[0], str)):
            continue
        labels, value = s[1], _number(s[2])
        if not isinstance(labels, dict) or value is None:
            continue
        if all(isinstance(v, str) for v in labels.values()):
            yield s[0], {k: str(v) for k, v in labels.items()}, value


def json_answer(figures: JsonValue) -> tuple[dict[str, JsonValue], dict[str, int]] | None:
    """A process's figures for the JSON form (`{"json": snapshot, "work": {…}}`)."""
    if not isinstance(figures, dict):
        return None
    snap = figures.get("json")
    work = _work(figures.get("work"))
    if not isinstance(snap, dict) or work is None:
        return None
    if not isinstance(snap.get("queues", {}), dict):
        return None
    return snap, work


def add_work(into: dict[str, int], work: dict[str, int]) -> None:
    for name, n in work.items():
        into[name] = into.get(name, 0) + n


def topic_names(own: list[str], others: Iterable[Families]) -> set[str]:
    """The topics whose series the merged answer keeps: the deployment's first
    `PER_TOPIC_MAX` by name (each process sent the first of those it counts)."""
    names = set(own)
    for families in others:
        for _, labels, _ in samples(families, PER_TOPIC_NAMES):
            names.add(labels.get("topic", ""))
    return set(sorted(names)[:PER_TOPIC_MAX])


def topic_count(own: int, others: Iterable[Families]) -> int:
    return own + sum(
        round(v) for families in others for _, _, v in samples(families, "topics_topics")
    )


def merge_family(
    family: Metric,
    others: list[Families],
    names: set[str],
    work: dict[str, int],
    topics: int,
) -> Metric:
    """`family` (the scraped process's) with the others' samples of it merged in."""
    levels = family.name in LEVEL_GAUGES
    if not (levels or summed(family)):
        return family
    merged: dict[tuple[str, tuple[tuple[str, str], ...]], tuple[dict[str, str], float]] = {}

    def add(name: str, labels: dict[str, str], value: float) -> None:
        key = (name, tuple(sorted(labels.items())))
        got = merged.get(key)
        merged[key] = (labels, value if got is None else got[1] + value)

    for s in family.samples:
        add(s.name, dict(s.labels), float(s.value))
    for families in others:
        for name, labels, value in samples(families, family.name):
            if not levels or labels.get("queue", "").startswith(LEVEL_PREFIX):
                add(name, labels, value)
    rows = [(name, labels, value) for (name, _), (labels, value) in merged.items()]
    if family.name == TRUNCATED:
        rows = [(name, labels, 1.0 if topics > PER_TOPIC_MAX else 0.0) for name, labels, _ in rows]
    if any("topic" in labels for _, labels, _ in rows):
        rows = [r for r in rows if r[1].get("topic") in names]
        rows.sort(key=lambda r: r[1]["topic"])  # (stable: a topic's own order is kept)
    if family.name == WORK_STREAMS:
        rows = [(n, labels, v + work.get(labels["topic"], 0)) for n, labels, v in rows]
    out = Metric(family.name, family.documentation, family.type, family.unit)
    for name, labels, value in rows:
        out.add_sample(name, labels, value)
    return out


def fronts_families(live: int, answered: int) -> list[Metric]:
    """How many processes the answer covers."""
    return [
        GaugeMetricFamily(
            "topicd_fronts_live",
            "Fronts of the deployment alive (its membership table), this one included.",
            value=live,
        ),
        GaugeMetricFamily(
            "topicd_fronts_answered",
            "Fronts whose figures this answer includes (this one included; the others "
            "did not answer in time).",
            value=answered,
        ),
    ]


def merge_json(
    own: dict[str, JsonValue], answers: list[dict[str, JsonValue]], work: dict[str, int]
) -> None:
    """Merge the others' JSON snapshots into `own` (in place); `work`: every process's
    `/work` streams on the queue topics it did not count."""
    queues = own.get("queues")
    internal = own.get("internal_queues")
    assert isinstance(queues, dict)
    assert isinstance(internal, list)
    for snap in answers:
        theirs = snap.get("internal_queues")
        if isinstance(theirs, list):
            internal.extend(
                e
                for e in theirs
                if isinstance(e, dict) and str(e.get("name", "")).startswith(LEVEL_PREFIX)
            )
        for key in JSON_SUMMED:
            mine, theirs = own.get(key), snap.get(key)
            if isinstance(mine, int) and isinstance(theirs, int):
                own[key] = mine + theirs
        got = snap.get("queues")
        if isinstance(got, dict):
            queues.update(got)
    kept: dict[str, JsonValue] = {}
    for name in sorted(queues)[:PER_TOPIC_MAX]:
        entry = queues[name]
        if isinstance(entry, dict) and name in work:
            streams = entry.get("work_streams")
            if isinstance(streams, int):
                entry["work_streams"] = streams + work[name]
        kept[name] = entry
    own["queues"] = kept
    internal.sort(key=lambda e: str(e.get("name")) if isinstance(e, dict) else "")
