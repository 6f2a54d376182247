"""The configuration registry: one frozen tree, loaded once, validated at start.

Every setting is a field of a frozen dataclass section. Its metadata (made by `key()`)
carries the one-line comment, the unit-bearing name, the environment variable names and the
bounds, so loading, validation, `topicd print-default-config`, `check-config --print` and
`conf/topicd.toml` all come from this single table (api-ops §5).

Precedence, highest first: command-line flags, `TOPICD_*` variables, legacy `TOPICS_*`
variables, the TOML file, the built-in default. The file is `--config FILE`, else
`$TOPICD_CONFIG`, else `conf/topicd.toml` if it exists, else none. Unknown sections or keys,
wrong types, out-of-range values and unparsable environment values raise `ConfigError`
naming the key (the command exits 2).
"""

from __future__ import annotations

import dataclasses
import hashlib
import ipaddress
import json
import os
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Final, TypeVar

if TYPE_CHECKING:
    from collections.abc import Iterator, Mapping

_T = TypeVar("_T")

LOG_LEVELS = ("error", "warn", "info", "debug", "trace")
DURABILITY_CLASSES = ("ephemeral", "memory", "disk", "fsync")


class ConfigError(Exception):
    """A configuration value is invalid; the message names the key."""


@dataclass(frozen=True)
class KeySpec:
    comment: str
    env: tuple[str, ...] | None  # explicit names (canonical first); None = derived name
    min: int | float | None
    max: int | float | None
    choices: tuple[str, ...] | None
    secret: bool
    contract: bool  # a protocol default that *is* the /v0 contract (check-config warns)


def key(
    default: _T,
    comment: str,
    *,
    env: tuple[str, ...] | None = None,
    min: float | None = None,
    max: float | None = None,
    choices: tuple[str, ...] | None = None,
    secret: bool = False,
    contract: bool = False,
) -> _T:
    """Declare one setting of a section (see module docstring)."""
    spec = KeySpec(comment, env, min, max, choices, secret, contract)
    if isinstance(default, tuple | list):
        frozen = tuple(default)
        return field(default_factory=lambda: frozen, metadata={"key": spec})  # type: ignore[return-value]
    return field(default=default, metadata={"key": spec})


def section(factory: type[_T], comment: str) -> _T:
    """Declare a nested section (a table inside a table)."""
    return field(default_factory=factory, metadata={"section": comment})


def _env2(name: str) -> tuple[str, str]:
    return (f"TOPICD_{name}", f"TOPICS_{name}")


# --------------------------------------------------------------------------------------
# Sections
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ServerConfig:
    host: str = key(
        "127.0.0.1",
        "Bind host. `host:port` or `[v6]:port` also sets the port; a bare IPv6 literal is a host.",
        env=_env2("HOST"),
    )
    port: int = key(4000, "Bind port; 0 = ephemeral.", env=_env2("PORT"), min=0, max=65535)
    port_file: str = key(
        "", "If set, the bound port is written here once listening.", env=_env2("PORT_FILE")
    )
    drain_timeout_ms: int = key(
        10000,
        "Max graceful drain on SIGINT/SIGTERM (ms).",
        env=("TOPICD_DRAIN_TIMEOUT_MS",),
        min=0,
        max=3_600_000,
    )
    header_read_timeout_ms: int = key(
        60000,
        "Time a connection may sit without a complete request head (ms).",
        env=("TOPICD_HEADER_READ_TIMEOUT_MS",),
        min=100,
        max=3_600_000,
    )
    http2: bool = key(True, "Accept h2c (HTTP/2 over cleartext).", env=("TOPICD_HTTP2",))
    direct_http1: bool = key(
        True,
        "Serve plain HTTP/1.1 requests on the socket directly (same gate and app); "
        "Hypercorn keeps h2c, upgrades, chunked bodies, Expect and HEAD.",
        env=("TOPICD_DIRECT_HTTP1",),
    )


@dataclass(frozen=True)
class HashedKey:
    """One `[[auth.key]]` table: a pre-hashed bearer key (api-ops §5.3)."""

    sha256: str
    scopes: tuple[str, ...] = ()
    prefixes: tuple[str, ...] = ()


@dataclass(frozen=True)
class AuthConfig:
    api_keys: tuple[str, ...] = key(
        (),
        "Bearer key entries `secret[:scopes[:prefixes]]`; empty everywhere = dev mode (no auth).",
        env=_env2("API_KEYS"),
        secret=True,
    )
    api_keys_file: str = key(
        "", "File with one key entry per line (`#` comments).", env=("TOPICD_API_KEYS_FILE",)
    )
    allow_insecure_no_auth: bool = key(
        False, "Permit a non-loopback bind without keys.", env=_env2("ALLOW_INSECURE_NO_AUTH")
    )
    probe_auth: bool = key(
        False, "Require a valid key on health/ready probes.", env=_env2("PROBE_AUTH")
    )
    key: tuple[HashedKey, ...] = field(default_factory=tuple, metadata={"tables": True})


@dataclass(frozen=True)
class SegmentsConfig:
    max_events: int = key(
        10000, "Seal a segment after N records.", env=_env2("SEGMENT_MAX_EVENTS"), min=1
    )
    max_bytes: int = key(
        67108864,
        "Seal a segment after N data bytes.",
        env=_env2("SEGMENT_MAX_BYTES"),
        min=1,
        max=1 << 31,
    )
    max_age_ms: int = key(
        3600000,
        "Seal a partial segment after this age; 0 = never by age.",
        env=_env2("SEGMENT_MAX_AGE_MS"),
        min=0,
    )
    inline_max_bytes: int = key(
        2048,
        "A topic that never had a segment keeps its records in the snapshot (and in "
        "memory) while their stored JSON totals at most this many bytes and they are at "
        "most 64; past that a checkpoint moves them into segment files, for good. 0 = "
        "segments from the first checkpoint on.",
        min=0,
        max=1 << 20,
    )


@dataclass(frozen=True)
class TieringConfig:
    hot_retain_segments: int = key(
        4,
        "Newest sealed segments of a topic kept hot; older ones move to storage.cold_dir.",
        env=_env2("HOT_RETAIN_SEGMENTS"),
        min=0,
    )
    hot_retain_bytes: int = key(
        0,
        "Optional hot byte bound per topic (sealed segments' bytes; 0 = none); the "
        "stricter bound wins.",
        env=_env2("HOT_RETAIN_BYTES"),
        min=0,
    )


@dataclass(frozen=True)
class WalConfig:
    file_bytes: int = key(67108864, "Preallocated WAL file size.", min=4096, max=1 << 40)
    max_frame_bytes: int = key(
        16777216,
        "Largest WAL frame written; a larger write is split across frames (recovery also "
        "reads single frames up to 1 GiB that topicd 0.1 wrote).",
        min=1 << 16,
        max=1 << 30,
    )
    gc_slice_us: int = key(
        500, "Group-commit coalescing slice: wait this long for more arrivals.", min=0
    )
    gc_enough_records: int = key(
        64,
        "Group commit stops waiting for more arrivals once a batch carries this many records.",
        min=1,
    )
    disk_fsync_interval_ms: int = key(
        100,
        "Background sync of the unsynced tail (bounds the disk-class loss window).",
        min=1,
    )
    disk_head_reserve_ahead: int = key(
        65536,
        "memory/disk seq reservation step (a write reserves max(this, 4n) ahead).",
        min=1,
    )
    ephemeral_head_reserve_ahead: int = key(65536, "ephemeral seq reservation step.", min=1)
    max_pending_per_topic: int = key(
        1024, "Accepted, uncommitted submissions per topic (429 wal_ingest beyond).", min=1
    )
    max_pending_bytes_per_topic: int = key(
        16777216, "Accepted, uncommitted bytes per topic.", min=1
    )
    max_pending_per_shard: int = key(4096, "Accepted, uncommitted submissions per shard.", min=1)
    max_pending_bytes_per_shard: int = key(
        67108864, "Accepted, uncommitted bytes per shard.", min=1
    )
    max_pending_ms: int = key(
        500,
        "Wait of a shard's oldest accepted, uncommitted write (ms, at the governor's "
        "sample) that reads as a full ingest: the backlog signal (s5) is the share of it, "
        "and writes get 429 once pressure reaches throttle_at with the wait at "
        "levels.critical of it (0 = no time bound).",
        min=0,
    )
    max_group_topics: int = key(64, "Topics per group-commit batch.", min=1)
    max_batch_per_topic: int = key(256, "Submissions per topic per batch.", min=1)
    max_batch_bytes: int = key(4194304, "Bytes per batch (one write).", min=1)


@dataclass(frozen=True)
class SnapshotConfig:
    wal_bytes_threshold: int = key(67108864, "Checkpoint after this much WAL was written.", min=1)
    interval_ms: int = key(60000, "Checkpoint at least this often.", min=100)
    check_interval_ms: int = key(5000, "How often the triggers are checked.", min=10)
    keep: int = key(2, "Snapshots retained.", min=1)
    final_timeout_ms: int = key(20000, "Bound on the drain-time checkpoint.", min=0)


@dataclass(frozen=True)
class RecoveryConfig:
    on_corruption: str = key(
        "refuse",
        "refuse, or truncate the WAL at the first bad frame (operator decision only).",
        choices=("refuse", "truncate"),
    )


@dataclass(frozen=True)
class JetStreamConfig:
    servers: tuple[str, ...] = key(
        ("nats://127.0.0.1:4222",),
        "NATS server URLs of the JetStream cluster (any subset; the client learns the rest).",
        env=("TOPICD_JETSTREAM_SERVERS",),
    )
    prefix: str = key(
        "topicd",
        "This deployment's streams, subjects and registry bucket are named after it "
        "(letters, digits, `-`, `_`); deployments sharing a cluster need distinct ones.",
        env=("TOPICD_JETSTREAM_PREFIX",),
    )
    request_timeout_ms: int = key(
        5000,
        "Bound on one JetStream request: a publish, purge, read or registry update (ms).",
        min=100,
        max=600000,
    )
    replicas: int = key(
        1,
        "Replicas of each topic's stream and of the registry (3: a write is acknowledged "
        "by a quorum of 2, one server may fail; needs a cluster of 3 or more).",
        min=1,
        max=5,
    )
    shards: int = key(
        1,
        "Owner shards of the deployment's topics (by a hash of the name): each has its own "
        "owner front, and fronts share them out evenly (docs/jetstream.md, several fronts). "
        "Every front of a deployment must use the same value; the first one records it.",
        min=1,
        max=64,
    )
    lease_ms: int = key(
        3000,
        "Term of an owner lease (ms): the front holding a shard's lease runs its topics' "
        "mutations and renews it every third of this; a front takes it over this long after "
        "the owner stopped renewing, or at once when the owner's connection is gone "
        "(docs/jetstream.md, several fronts).",
        min=300,
        max=600000,
    )


@dataclass(frozen=True)
class StorageConfig:
    backend: str = key(
        "embedded",
        "embedded (write-ahead log and segments in data_dir) or jetstream (streams on a "
        "NATS JetStream cluster, docs/jetstream.md).",
        env=("TOPICD_STORAGE_BACKEND",),
        choices=("embedded", "jetstream"),
    )
    data_dir: str = key(
        "./topicd-data",
        "Data directory (locked: one process per directory).",
        env=_env2("DATA_DIR"),
    )
    cold_dir: str = key(
        "",
        "Cold tier root: sealed segments past storage.tiering's bound move here; empty = "
        "tiering off. Not inside data_dir.",
        env=_env2("COLD_DIR"),
    )
    wal_shards: int = key(
        0,
        "WAL shard count 1..8; 0 = min(CPUs, 8). May change between restarts.",
        env=_env2("WAL_SHARDS"),
        min=0,
        max=8,
    )
    payload_cache_bytes: int = key(
        268435456,
        "Bound on the payloads of absorbed records kept in memory (one LRU for all "
        "topics); records not yet in segments stay in memory besides it.",
        min=0,
    )
    segments: SegmentsConfig = section(SegmentsConfig, "Per-topic segment files")
    wal: WalConfig = section(WalConfig, "Write-ahead log: files, group commit, ingest bounds")
    snapshot: SnapshotConfig = section(SnapshotConfig, "Checkpoints and snapshots")
    recovery: RecoveryConfig = section(RecoveryConfig, "Recovery")
    tiering: TieringConfig = section(TieringConfig, "Cold tier: which sealed segments stay hot")
    jetstream: JetStreamConfig = section(
        JetStreamConfig, 'The jetstream backend\'s cluster (storage.backend = "jetstream")'
    )


@dataclass(frozen=True)
class LimitsConfig:
    max_topics: int = key(
        100000, "Topics existing at once; 0 = unlimited.", env=_env2("MAX_TOPICS"), min=0
    )
    max_routers: int = key(
        10000,
        "Routers existing at once; 0 = unlimited.",
        env=_env2("MAX_ROUTERS"),
        min=0,
    )
    max_watch_sessions: int = key(
        10000,
        "Live watch sessions (with several jetstream fronts, of all of them together, "
        "at a registry round trip per create); 0 = unlimited.",
        env=_env2("MAX_WATCH_SESSIONS"),
        min=0,
    )
    max_sse_connections: int = key(
        10000,
        "Open streams (SSE watch, `/work`, dashboard feeds, WebSockets; with several "
        "jetstream fronts, of all of them together); 0 = unlimited.",
        env=_env2("MAX_SSE_CONNECTIONS"),
        min=0,
    )
    max_sse_connections_per_key: int = key(
        1000,
        "Open streams per key (auth on only; with several jetstream fronts, of all of "
        "them together); 0 = unlimited.",
        env=_env2("MAX_SSE_CONNECTIONS_PER_KEY"),
        min=0,
    )
    max_inflight_per_key: int = key(
        1000,
        "Concurrent non-streaming requests per key (auth on only; with several jetstream "
        "fronts, of all of them together, at a registry round trip per request); "
        "0 = unlimited.",
        env=_env2("MAX_INFLIGHT_PER_KEY"),
        min=0,
    )
    max_total_bytes: int = key(
        0,
        "Live record bytes across all topics; 0 = unlimited.",
        env=_env2("MAX_TOTAL_BYTES"),
        min=0,
    )
    max_idempotency_entries: int = key(
        1000000,
        "Unexpired idempotency entries across topics; 0 = unlimited.",
        env=("TOPICD_MAX_IDEMPOTENCY_ENTRIES",),
        min=0,
    )
    max_body_bytes: int = key(
        67108864,
        "Raw (decoded) request body bound, checked before parsing (413).",
        env=_env2("MAX_BODY_BYTES"),
        min=1024,
    )


@dataclass(frozen=True)
class ProtocolConfig:
    max_batch_records: int = key(
        10000,
        "Records per write (400 batch_too_large).",
        env=_env2("MAX_BATCH_RECORDS"),
        min=1,
        contract=True,
    )
    max_record_bytes: int = key(
        1048576,
        "Minified data+meta bytes per record (400 record_too_large).",
        env=_env2("MAX_RECORD_BYTES"),
        min=1,
        contract=True,
    )
    max_meta_bytes: int = key(
        16384,
        "Minified meta bytes per record.",
        env=_env2("MAX_META_BYTES"),
        min=1,
        contract=True,
    )
    max_meta_keys: int = key(
        64, "Keys of an object meta.", env=("TOPICD_MAX_META_KEYS",), min=1, contract=True
    )
    max_tag_bytes: int = key(
        256, "UTF-8 bytes of a tag.", env=_env2("MAX_TAG_BYTES"), min=1, contract=True
    )
    max_node_bytes: int = key(
        128, "UTF-8 bytes of a node id.", env=_env2("MAX_NODE_BYTES"), min=1, contract=True
    )
    max_idempotency_key_bytes: int = key(
        256,
        "UTF-8 bytes of an idempotency key.",
        env=("TOPICD_MAX_IDEMPOTENCY_KEY_BYTES",),
        min=1,
        contract=True,
    )
    default_limit: int = key(
        256, "Diff `limit` when 0 or absent.", env=("TOPICD_DEFAULT_LIMIT",), min=1, contract=True
    )
    max_limit: int = key(
        1000,
        "Diff `limit` clamp.",
        env=("TOPICD_MAX_LIMIT", "TOPICS_MAX_LIMIT"),
        min=1,
        contract=True,
    )
    max_wait_ms: int = key(
        30000, "Diff `wait_ms` clamp.", env=("TOPICD_MAX_WAIT_MS",), min=0, contract=True
    )
    default_max_batch_bytes: int = key(
        1048576,
        "Diff response byte budget when 0 or absent.",
        env=("TOPICD_DEFAULT_MAX_BATCH_BYTES",),
        min=1,
        contract=True,
    )
    max_batch_bytes: int = key(
        8388608,
        "Diff response byte budget clamp.",
        env=("TOPICD_MAX_BATCH_BYTES",),
        min=1,
        contract=True,
    )
    max_scan_per_read: int = key(
        100000,
        "Seqs one read may examine before returning early (caught_up:false).",
        env=("TOPICD_MAX_SCAN_PER_READ",),
        min=1,
        contract=True,
    )
    default_page_size: int = key(
        100, "List page size when absent.", env=("TOPICD_DEFAULT_PAGE_SIZE",), min=1, contract=True
    )
    max_page_size: int = key(
        1000, "List page size clamp.", env=("TOPICD_MAX_PAGE_SIZE",), min=1, contract=True
    )


@dataclass(frozen=True)
class WatchConfig:
    max_watch_topics: int = key(
        256,
        "Topics per watch session (400 beyond).",
        env=_env2("MAX_WATCH_TOPICS"),
        min=1,
        contract=True,
    )
    session_ttl_ms: int = key(
        300000,
        "An idle session without a stream is reclaimed after this.",
        env=("TOPICD_SESSION_TTL_MS",),
        min=1000,
        contract=True,
    )
    default_heartbeat_ms: int = key(
        15000,
        "Heartbeat period when the session gives none.",
        env=("TOPICD_DEFAULT_HEARTBEAT_MS",),
        min=1,
        contract=True,
    )
    min_heartbeat_ms: int = key(
        1000,
        "Heartbeat clamp, lower bound (see TOPICD_TEST_MIN_HEARTBEAT_MS).",
        env=("TOPICD_MIN_HEARTBEAT_MS",),
        min=1000,
        contract=True,
    )
    max_heartbeat_ms: int = key(
        60000,
        "Heartbeat clamp, upper bound.",
        env=("TOPICD_MAX_HEARTBEAT_MS",),
        min=1000,
        contract=True,
    )
    sse_retry_ms: int = key(
        2000, "The SSE `retry:` value.", env=("TOPICD_SSE_RETRY_MS",), min=0, contract=True
    )
    slow_consumer_timeout_ms: int = key(
        30000,
        "A single socket write blocked this long closes the stream.",
        env=("TOPICD_SLOW_CONSUMER_TIMEOUT_MS",),
        min=100,
        contract=True,
    )
    ws_outbound_queue: int = key(
        4,
        "Messages queued per WebSocket connection (replies and live frames); a full "
        "queue marks the connection lagged: it catches up from the log.",
        env=("TOPICD_WS_OUTBOUND_QUEUE",),
        min=1,
        contract=True,
    )


@dataclass(frozen=True)
class QueueConfig:
    max_claim: int = key(
        1000,
        "Claim `max` clamp; ack/nack/extend `seqs` bound.",
        env=_env2("MAX_CLAIM"),
        min=1,
        contract=True,
    )
    min_lease_ms: int = key(
        100,
        "Lower clamp of a topic's `lease_ms`.",
        env=("TOPICD_MIN_LEASE_MS",),
        min=1,
        contract=True,
    )
    max_lease_ms: int = key(
        86400000,
        "Upper clamp of a topic's `lease_ms`.",
        env=("TOPICD_MAX_LEASE_MS",),
        min=1,
        contract=True,
    )
    max_claim_jitter_ms: int = key(
        5000,
        "Upper clamp of a topic's `claim_jitter_ms`.",
        env=("TOPICD_MAX_CLAIM_JITTER_MS",),
        min=0,
        contract=True,
    )
    max_nack_delay_ms: int = key(
        86400000,
        "Nack `delay_ms` clamp.",
        env=("TOPICD_MAX_NACK_DELAY_MS",),
        min=0,
        contract=True,
    )
    work_heartbeat_ms: int = key(
        15000,
        "`/work` stream: a `: hb` comment after this long with nothing written.",
        env=("TOPICD_WORK_HEARTBEAT_MS",),
        min=1,
        contract=True,
    )
    work_poll_ms: int = key(
        250,
        "`/work` stream: longest wait between refill checks (changes wake it sooner).",
        env=("TOPICD_WORK_POLL_MS",),
        min=1,
        contract=True,
    )
    depth_retry_min_ms: int = key(
        500, "Lower clamp of a job queue's depth-level `retry_after_ms`.", min=1
    )
    depth_retry_max_ms: int = key(
        30000, "Upper clamp of a job queue's depth-level `retry_after_ms`.", min=1
    )
    ack_rate_window_ms: int = key(
        10000, "Time constant of the measured ack rate (EWMA) behind that hint.", min=1
    )


@dataclass(frozen=True)
class RoutersConfig:
    tick_ms: int = key(
        50,
        "Background forwarding sweep interval.",
        env=("TOPICD_ROUTER_TICK_MS",),
        min=1,
    )
    batch: int = key(
        1024,
        "Max source records per router per pass before yielding.",
        env=("TOPICD_ROUTER_BATCH",),
        min=1,
    )
    max_hops: int = key(
        8,
        "Hop cap for allow_cycle graphs: a copy that has made this many hops is not "
        "forwarded again.",
        env=("TOPICD_ROUTER_MAX_HOPS",),
        min=1,
    )
    cursor_log_ms: int = key(
        1000,
        "How often a router's moved cursor is logged (RouterCursor frame, not synced).",
        env=("TOPICD_ROUTER_CURSOR_LOG_MS",),
        min=1,
    )


@dataclass(frozen=True)
class SchedulerConfig:
    shards: int = key(
        1, "Delivery shards = scheduler tasks (one loop: more adds no speed).", min=1, max=64
    )
    band_thresholds: tuple[int, ...] = key(
        (750, 500, 250, 0), "Lower bounds of bands B4, B3, B2, B1 (below: B0)."
    )
    band_weights: tuple[int, ...] = key((8, 4, 2, 1, 1), "DWRR weights of B4 .. B0.")
    aging_rate_per_s: int = key(100, "Priority points a waiting topic gains per second.", min=1)
    aging_cap: int = key(1000, "Largest aging boost.", min=0)
    aging_tick_ms: int = key(50, "Aging tick (band promotions).", min=1)
    auto_max: int = key(500, "Recency bonus of a topic read just now.", min=0)
    half_life_ms: int = key(30000, "Recency bonus half-life.", min=1)
    auto_floor_ms: int = key(300000, "Unread this long: no recency bonus.", min=1)
    priority_min: int = key(-1000, "Lower clamp of a topic's manual `priority`.")
    priority_max: int = key(1000, "Upper clamp of a topic's manual `priority`.")
    drain_max_records: int = key(4096, "Newly published records one drain handles.", min=1)
    deficit_cap_rounds: int = key(2, "DWRR deficit cap, in rounds of credit.", min=1)


@dataclass(frozen=True)
class SseConfig:
    channel_frames: int = key(
        1024, "Frames one SSE connection may have queued before it is marked lagged.", min=1
    )
    channel_bytes: int = key(
        8388608, "Bytes one SSE connection may have queued before it is marked lagged.", min=1
    )
    catchup_concurrency: int = key(8, "Lagged connections catching up at once.", min=1)
    direct_write: bool = key(
        True,
        "Serve HTTP/1.1 streams on the socket directly, not through Hypercorn's ASGI send.",
    )


@dataclass(frozen=True)
class IoConfig:
    misc_threads: int = key(4, "Worker threads for misc file operations.", min=1, max=64)
    read_threads: int = key(8, "Worker threads for cache-miss reads.", min=1, max=64)


@dataclass(frozen=True)
class BreakerConfig:
    failure_threshold: int = key(5, "WAL write errors within the window that open it.", min=1)
    failure_window_ms: int = key(10000, "Window for counting write errors.", min=1)
    io_stall_ms: int = key(10000, "A WAL syscall outstanding this long opens it.", min=1)
    open_ms: int = key(30000, "Open time before half-open probes.", min=1)
    max_open_ms: int = key(300000, "Cap of the doubling open time.", min=1)
    probe_interval_ms: int = key(1000, "Half-open probe period.", min=1)
    success_threshold: int = key(2, "Consecutive probe successes that close it.", min=1)
    unready_when_open: bool = key(False, "/v0/ready answers 503 while a breaker is not closed.")


@dataclass(frozen=True)
class BackpressureConfig:
    allow_bypass: bool = key(True, "Honour disable_backpressure on writes.")
    bypass_wait_ms: int = key(
        30000,
        "Longest wait of a disable_backpressure write at a full ingest queue, and of a "
        "durable write at a full checkpoint backlog (then 429).",
        min=0,
    )
    retry_after_min_ms: int = key(250, "Lower bound of retry_after_ms.", min=1)
    retry_after_pressure_span_ms: int = key(1750, "retry_after_ms added at pressure 1.0.", min=0)
    retry_after_max_ms: int = key(10000, "Upper bound of retry_after_ms.", min=1)
    retry_after_jitter: float = key(0.2, "± jitter fraction on retry_after_ms.", min=0, max=1)


@dataclass(frozen=True)
class GovernorConfig:
    sample_interval_ms: int = key(100, "Period of the governor's sample.", min=10, max=10000)
    ewma_alpha: float = key(0.3, "Smoothing of pressure toward the raw signal.", min=0.01, max=1)
    sched_latency_alpha: float = key(
        0.2, "EWMA weight of one drain's scheduling latency (signal s2).", min=0.01, max=1
    )
    loop_lag_alpha: float = key(
        0.3, "EWMA weight of one sample's loop lag (signal s2).", min=0.01, max=1
    )
    depth_per_worker: int = key(
        64, "Ripe dirty topics per delivery shard that read as saturation (s1).", min=1
    )
    latency_ceiling_ms: float = key(
        5.0, "Scheduling latency or loop lag that reads as saturation (s2, ms).", min=0.1
    )
    latency_signal_max: float = key(
        0.6,
        "Most that the latency signal (s2) adds to pressure while the loop lag is under "
        "loop_overload_ms: a loop at capacity reads as the client's soft threshold; only "
        "work piling up (a loop lag past loop_overload_ms, s1, s3, s4, s5) goes higher, to "
        "deferral, the client's pause and the write throttle (1 = no cap).",
        min=0,
        max=1,
    )
    loop_overload_ms: float = key(
        25.0,
        "Loop lag (EWMA, ms) above which the latency signal (s2) rises past "
        "latency_signal_max, linearly to 1.0 at loop_refuse_ms: a scheduling batch this "
        "long is a queue of requests on the loop, not saturation.",
        min=0,
    )
    loop_refuse_ms: float = key(
        100.0,
        "Loop lag (EWMA, ms) at which s2 reads 1.0, and client requests get 429 "
        "throttled cause loop_lag once pressure held refuse_above (0 = neither).",
        min=0,
    )
    sojourn_overload_ms: float = key(
        50.0,
        "Median sojourn of client writes (request read to answer ready, ms) at which the "
        "sojourn signal (s6) reads latency_signal_max (proportional below); above it the "
        "signal rises linearly to 1.0 at sojourn_refuse_ms.",
        min=0,
    )
    sojourn_refuse_ms: float = key(
        200.0,
        "Median write sojourn (ms) at which s6 reads 1.0, and client requests get 429 "
        "throttled cause write_delay once pressure held refuse_above (0 = neither).",
        min=0,
    )
    sojourn_window_ms: float = key(
        300.0,
        "The writes answered in this last span (ms) that met another write in the server "
        "make the median of s6 (at most the newest 1024; a write alone, with no other in "
        "hand when it came and none before its answer, is left out).",
        min=1,
    )
    admission_waiters_per_permit: float = key(
        1.0,
        "Client requests waiting for a permit, per permit, that read as saturation "
        "(s4 admission; 0 = signal off).",
        min=0,
    )
    admission_refuse_fill: float = key(
        0.6,
        "Share of the client waiter slots (classes.client_waiters) taken at which s4 "
        "reads 1.0. Above 0, s4 reads latency_signal_max (the client's soft threshold) "
        "at admission_soft_per_permit waiting per permit and rises from there to 1.0 at "
        "this fill, ahead of the 429 client_waiters (0, or a fill at or below "
        "admission_waiters_per_permit per permit = 1.0 at admission_waiters_per_permit "
        "per permit).",
        min=0,
        max=1,
    )
    admission_soft_per_permit: float = key(
        1.0,
        "With admission_refuse_fill above 0: client requests waiting per permit at "
        "which s4 reads latency_signal_max, the producers' soft threshold (at most half "
        "the refuse fill, at least admission_waiters_per_permit). Deeper lets law-on "
        "producers keep more writes queued at the gate.",
        min=0,
    )
    coalesce_above: float = key(0.2, "Pressure above which frames coalesce.", min=0, max=1)
    coalesce_max_ms: float = key(20.0, "Coalescing window at pressure 1.0 (ms).", min=0, max=1000)
    widen_above: float = key(
        0.4, "Pressure above which the group-commit window widens.", min=0, max=1
    )
    commit_window_min_ms: float = key(
        0.5, "Group-commit window at low pressure (ms).", min=0, max=1000
    )
    commit_window_max_ms: float = key(
        10.0, "Group-commit window at high pressure (ms).", min=0, max=1000
    )
    defer_above: float = key(
        0.8, "Sustained pressure above which low-priority push pauses.", min=0, max=1
    )
    defer_release_below: float = key(
        0.6, "Pressure below which deferral ends (hysteresis).", min=0, max=1
    )
    defer_sustain_samples: int = key(
        3, "Consecutive samples above defer_above that start deferral.", min=1
    )
    refuse_above: float = key(
        0.9,
        "Pressure that, held for refuse_sustain_samples while the loop-lag signal (s2, "
        "past loop_overload_ms), the WAL backlog signal (s5) or the write sojourn signal "
        "(s6) is at it too, makes client requests get 429 (cause loop_lag, wal_backlog or "
        "write_delay); 0.9 is the client library's pause, so producers that follow the "
        "header are not the ones refused.",
        min=0,
        max=1,
    )
    refuse_sustain_samples: int = key(
        3, "Consecutive samples at refuse_above before the overload refusal.", min=1
    )
    throttle_at: float = key(
        0.98,
        "Pressure at which writes to a WAL shard whose ingest is critical get 429.",
        min=0,
        max=1,
    )


@dataclass(frozen=True)
class LevelsConfig:
    warning: float = key(0.70, "Queue fill ratio of the warning level.", min=0, max=1)
    critical: float = key(
        0.85, "Critical level (a WAL ingest here arms pressure admission).", min=0, max=1
    )
    overflow: float = key(0.95, "Overflow level (above it).", min=0, max=1)
    hysteresis: float = key(0.05, "A level is left this far below its bound.", min=0, max=1)
    warn_log_interval_ms: int = key(
        60000, "At most one level warning per queue in this interval.", min=0
    )


@dataclass(frozen=True)
class ClassesConfig:
    client_permits: int = key(
        32, "Client requests running at once (probes, metrics and streams take none).", min=1
    )
    client_waiters: int = key(
        4096, "Client requests waiting for a permit before 429 client_waiters.", min=0
    )
    maintenance_permits: int = key(
        2, "Maintenance jobs (checkpoints, retention sweeps) running at once.", min=1, max=64
    )
    quantum_base_us: int = key(
        250,
        "Yield quantum unit (µs): a long loop yields after weight × this (control 8, "
        "delivery 4, client 2, maintenance 1).",
        min=10,
        max=100000,
    )
    quantum_items: int = key(
        256,
        "A long loop also yields after this many items, whatever the time (the bound a "
        "virtual clock can test).",
        min=1,
        max=1000000,
    )


@dataclass(frozen=True)
class DashboardConfig:
    enabled: bool = key(True, "Serve the operator dashboard page and its live feed.")
    path: str = key(
        "/_topicd/dashboard",
        "Path of the page; its SSE feed is this path plus `/events`. Outside `/v0`.",
    )
    interval_ms: int = key(
        1000, "Period of the feed's snapshots while a viewer is attached.", min=100, max=60000
    )
    top_n: int = key(50, "Topics shown, by lag (highest first).", min=1, max=1000)
    max_viewers: int = key(
        16,
        "Open feed streams at once (beyond: 429; they also count as SSE connections; with "
        "several jetstream fronts, of all of them together).",
        min=1,
    )
    history_points: int = key(
        300, "Snapshots the charts keep (300 × 1 s: the last five minutes).", min=10, max=3600
    )
    pressure_warn: float = key(0.4, "Pressure from which the zone is amber.", min=0, max=1)
    pressure_pause: float = key(0.8, "Pressure from which the zone is red.", min=0, max=1)
    lag_warn: int = key(1000, "Topic or router lag (records) from which it is amber.", min=0)
    lag_pause: int = key(10000, "Topic or router lag (records) from which it is red.", min=0)
    inflight_warn: int = key(50, "Queue jobs in flight from which it is amber.", min=0)
    inflight_pause: int = key(200, "Queue jobs in flight from which it is red.", min=0)
    worker_stale_ms: int = key(
        10000,
        "A queue with no claim, extend, ack or nack for this long and no /work stream "
        'shows "worker off".',
        min=100,
    )
    stale_after_intervals: int = key(
        3, "The page greys out as stale after this many intervals without a snapshot.", min=2
    )


@dataclass(frozen=True)
class EngineConfig:
    housekeeping_interval_ms: int = key(
        1000,
        "Period of the retention sweep that expires TTL records of idle topics (ms).",
        min=10,
        max=60000,
    )
    gc_threshold0: int = key(
        10000,
        "Generation-0 GC threshold after start-up (start-up objects are gc.freeze()-d).",
        min=100,
    )
    gil_switch_interval_us: int = key(
        5000,
        "GIL switch interval while serving (µs; 5000 is Python's own): the longest the "
        "event loop waits for the GIL behind a worker thread running Python each time it "
        "comes back from a blocking call.",
        min=100,
        max=100000,
    )


@dataclass(frozen=True)
class LoggingConfig:
    level: str = key(
        "info",
        "error|warn|info|debug|trace, or per-logger `name=level,...` filters.",
        env=("TOPICD_LOG",),
    )
    format: str = key(
        "text",
        "text, or json (one object per line).",
        env=("TOPICD_LOG_FORMAT",),
        choices=("text", "json"),
    )
    access_log: bool = key(
        False,
        "Per-request lines: method, path template, status, ms (never tokens or queries).",
        env=("TOPICD_ACCESS_LOG",),
    )


@dataclass(frozen=True)
class Config:
    server: ServerConfig = section(ServerConfig, "HTTP listener")
    auth: AuthConfig = section(AuthConfig, "Bearer-key authentication (README §2)")
    storage: StorageConfig = section(StorageConfig, "Data directory")
    limits: LimitsConfig = section(LimitsConfig, "Resource caps (api-ops §4.1): over ⇒ 429")
    protocol: ProtocolConfig = section(
        ProtocolConfig,
        "Protocol limits (api-ops §4.2). The defaults ARE the /v0 contract; "
        "check-config warns on any change.",
    )
    watch: WatchConfig = section(WatchConfig, "SSE watch (api-routers-watch §2)")
    queue: QueueConfig = section(QueueConfig, "Queue topics")
    routers: RoutersConfig = section(RoutersConfig, "Routers")
    scheduler: SchedulerConfig = section(SchedulerConfig, "Delivery scheduling (scheduler spec)")
    sse: SseConfig = section(SseConfig, "SSE connections")
    engine: EngineConfig = section(EngineConfig, "Engine housekeeping")
    io: IoConfig = section(IoConfig, "Offload threads")
    breaker: BreakerConfig = section(BreakerConfig, "Storage circuit breaker (per WAL shard)")
    backpressure: BackpressureConfig = section(BackpressureConfig, "Write backpressure")
    governor: GovernorConfig = section(GovernorConfig, "Pressure governor")
    classes: ClassesConfig = section(ClassesConfig, "Work classes (scheduler spec R1)")
    levels: LevelsConfig = section(LevelsConfig, "Queue-depth levels (scheduler spec R5)")
    dashboard: DashboardConfig = section(DashboardConfig, "Operator dashboard (docs/dashboard.md)")
    logging: LoggingConfig = section(LoggingConfig, "Logging")


DEFAULT = Config()


# --------------------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------------------

_PLAIN_INT = re.compile(r"-?[0-9]+")
_BOOL_TRUE = {"1", "true", "yes", "on"}
_BOOL_FALSE = {"0", "false", "no", "off", ""}


def _fields(cls: type[object]) -> tuple[dataclasses.Field[object], ...]:
    assert dataclasses.is_dataclass(cls)
    return dataclasses.fields(cls)


def env_names(path: str, spec: KeySpec) -> tuple[str, ...]:
    """Environment variables for `path` (e.g. `server.host`), canonical first."""
    if spec.env is not None:
        return spec.env
    return ("TOPICD_" + path.upper().replace(".", "_"),)


def _check_type(path: str, value: object, default: object) -> object:
    if isinstance(default, bool):
        if not isinstance(value, bool):
            raise ConfigError(f"{path}: expected a boolean, got {value!r}")
        return value
    if isinstance(default, int):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{path}: expected an integer, got {value!r}")
        return value
    if isinstance(default, float):
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(f"{path}: expected a number, got {value!r}")
        return float(value)
    if isinstance(default, str):
        if not isinstance(value, str):
            raise ConfigError(f"{path}: expected a string, got {value!r}")
        return value
    if isinstance(default, tuple):
        if default and isinstance(default[0], int):
            if not isinstance(value, list) or not all(
                isinstance(v, int) and not isinstance(v, bool) for v in value
            ):
                raise ConfigError(f"{path}: expected a list of integers, got {value!r}")
            if len(value) != len(default):
                raise ConfigError(f"{path}: expected {len(default)} integers, got {len(value)}")
            return tuple(value)
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise ConfigError(f"{path}: expected a list of strings, got {value!r}")
        return tuple(value)
    raise AssertionError(f"unsupported default type for {path}")


def _parse_env(path: str, var: str, raw: str, default: object) -> object:
    if isinstance(default, bool):
        low = raw.strip().lower()
        if low in _BOOL_TRUE:
            return True
        if low in _BOOL_FALSE:
            return False
        raise ConfigError(f"{path}: {var}={raw!r} is not a boolean (1/true/yes/on, 0/false/no/off)")
    if isinstance(default, int):
        text = raw.strip()
        if not _PLAIN_INT.fullmatch(text):
            raise ConfigError(f"{path}: {var}={raw!r} is not a plain integer")
        return int(text)
    if isinstance(default, float):
        try:
            return float(raw.strip())
        except ValueError:
            raise ConfigError(f"{path}: {var}={raw!r} is not a number") from None
    if isinstance(default, str):
        return raw
    if isinstance(default, tuple):
        parts = [part.strip() for part in raw.split(",") if part.strip()]
        if default and isinstance(default[0], int):
            if not all(_PLAIN_INT.fullmatch(p) for p in parts):
                raise ConfigError(f"{path}: {var}={raw!r} is not a list of plain integers")
            return _check_type(path, [int(p) for p in parts], default)
        return tuple(parts)
    raise AssertionError(f"unsupported default type for {path}")


def _check_bounds(path: str, value: object, spec: KeySpec) -> None:
    if isinstance(value, int | float) and not isinstance(value, bool):
        if spec.min is not None and value < spec.min:
            raise ConfigError(f"{path}: {value} is below the minimum {spec.min:g}")
        if spec.max is not None and value > spec.max:
            raise ConfigError(f"{path}: {value} is above the maximum {spec.max:g}")
    if spec.choices is not None and value not in spec.choices:
        raise ConfigError(f"{path}: {value!r} is not one of {', '.join(spec.choices)}")


def _load_hashed_keys(path: str, value: object) -> tuple[HashedKey, ...]:
    if not isinstance(value, list):
        raise ConfigError(f"{path}: expected an array of tables ([[auth.key]])")
    out: list[HashedKey] = []
    for i, item in enumerate(value):
        where = f"{path}[{i}]"
        if not isinstance(item, dict):
            raise ConfigError(f"{where}: expected a table")
        unknown = set(item) - {"sha256", "scopes", "prefixes"}
        if unknown:
            raise ConfigError(f"{where}: unknown key {sorted(unknown)[0]!r}")
        digest = item.get("sha256")
        if not isinstance(digest, str) or len(digest) != 64:
            raise ConfigError(f"{where}.sha256: expected 64 hex characters")
        try:
            bytes.fromhex(digest)
        except ValueError:
            raise ConfigError(f"{where}.sha256: expected 64 hex characters") from None
        scopes = _check_type(f"{where}.scopes", item.get("scopes", []), ())
        prefixes = _check_type(f"{where}.prefixes", item.get("prefixes", []), ())
        assert isinstance(scopes, tuple)
        assert isinstance(prefixes, tuple)
        out.append(HashedKey(digest.lower(), scopes, prefixes))
    return tuple(out)


def _build(
    cls: type[_T],
    prefix: str,
    table: Mapping[str, object],
    env: Mapping[str, str],
    flags: Mapping[str, object],
) -> _T:
    known = {f.name for f in _fields(cls)}
    for name in table:
        if name not in known:
            what = "section" if isinstance(table[name], dict) else "key"
            raise ConfigError(f"unknown {what} {prefix}{name!s}")
    kwargs: dict[str, object] = {}
    for f in _fields(cls):
        path = prefix + f.name
        if "section" in f.metadata:
            sub = table.get(f.name, {})
            if not isinstance(sub, dict):
                raise ConfigError(f"{path}: expected a table")
            assert callable(f.default_factory)
            sub_cls = type(f.default_factory())
            kwargs[f.name] = _build(sub_cls, path + ".", sub, env, flags)
            continue
        if "tables" in f.metadata:
            kwargs[f.name] = _load_hashed_keys(path, table.get(f.name, []))
            continue
        spec = f.metadata["key"]
        assert isinstance(spec, KeySpec)
        default = f.default_factory() if callable(f.default_factory) else f.default
        value: object = default
        if f.name in table:
            value = _check_type(path, table[f.name], default)
        for var in reversed(env_names(path, spec)):  # legacy first, canonical overrides
            if var in env:
                value = _parse_env(path, var, env[var], default)
        if path in flags:
            value = _check_type(path, flags[path], default)
        _check_bounds(path, value, spec)
        kwargs[f.name] = value
    return cls(**kwargs)


def resolve_config_path(explicit: str | None, env: Mapping[str, str]) -> Path | None:
    """The file `serve` and `check-config` read (api-ops §5.1)."""
    if explicit:
        return Path(explicit)
    if env.get("TOPICD_CONFIG"):
        return Path(env["TOPICD_CONFIG"])
    default = Path("conf/topicd.toml")
    return default if default.is_file() else None


def load_config(
    path: Path | None,
    env: Mapping[str, str] | None = None,
    flags: Mapping[str, object] | None = None,
) -> Config:
    """Load, merge and validate. Raises `ConfigError` naming the offending key.

    Args:
        path: TOML file, or None for defaults + env only.
        env: environment (defaults to `os.environ`).
        flags: command-line overrides by key path, e.g. `{"server.port": 0}`.
    """
    env = os.environ if env is None else env
    flags = {} if flags is None else flags
    table: dict[str, object] = {}
    if path is not None:
        try:
            with path.open("rb") as fh:
                table = tomllib.load(fh)
        except FileNotFoundError:
            raise ConfigError(f"config file {path} does not exist") from None
        except OSError as exc:
            raise ConfigError(f"config file {path}: {exc.strerror}") from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"config file {path}: {exc}") from None
    cfg = _build(Config, "", table, env, flags)
    cfg = _test_heartbeat_floor(cfg, env)
    cfg = _post_process(cfg, port_flag="server.port" in flags)
    refuse_unimplemented(cfg)
    return cfg


# Settings registered for features this version does not have yet: a value other than the
# default would be accepted and then do nothing, so it is refused instead (naming the key).
# A key is a full path or a whole section; each feature's change removes its own entries.
NOT_IMPLEMENTED: Final[dict[str, str]] = {}


def _leaves(obj: object, prefix: str = "") -> Iterator[tuple[str, object]]:
    """(key path, value) of every setting under `obj`."""
    for f in _fields(type(obj)):
        value = getattr(obj, f.name)
        if "section" in f.metadata:
            yield from _leaves(value, f"{prefix}{f.name}.")
        else:
            yield prefix + f.name, value


def refuse_unimplemented(cfg: Config) -> None:
    """Raise `ConfigError` naming the first `NOT_IMPLEMENTED` key set to anything but its
    default (`serve` and `check-config` exit 2)."""
    for (path, value), (_, default) in zip(_leaves(cfg), _leaves(DEFAULT), strict=True):
        if value == default:
            continue
        for entry, feature in NOT_IMPLEMENTED.items():
            if path == entry or path.startswith(entry + "."):
                raise ConfigError(
                    f"{path}: not implemented in this version ({feature}); only the "
                    f"default {_toml_value(default)} is accepted (remove the setting)"
                )


TEST_MIN_HEARTBEAT_ENV: Final = ("TOPICD_TEST_MIN_HEARTBEAT_MS", "TOPICS_TEST_MIN_HEARTBEAT_MS")


def _test_heartbeat_floor(cfg: Config, env: Mapping[str, str]) -> Config:
    """Test-only (api-ops §5.2): lower the heartbeat floor to 1..1000 ms; never raise it."""
    for var in TEST_MIN_HEARTBEAT_ENV:
        raw = env.get(var)
        if raw is None:
            continue
        if not _PLAIN_INT.fullmatch(raw.strip()) or not 1 <= int(raw) <= 1000:
            raise ConfigError(f"watch.min_heartbeat_ms: {var}={raw!r} is not an integer in 1..1000")
        floor = min(int(raw), cfg.watch.min_heartbeat_ms)
        return dataclasses.replace(
            cfg, watch=dataclasses.replace(cfg.watch, min_heartbeat_ms=floor)
        )
    return cfg


def split_host_port(host: str) -> tuple[str, int | None]:
    """`host:port` / `[v6]:port` → (host, port); a bare IPv6 literal is a host."""
    if host.startswith("["):
        end = host.find("]")
        if end < 0:
            raise ConfigError(f"server.host: {host!r} has an unclosed '['")
        inner, rest = host[1:end], host[end + 1 :]
        if not rest:
            return inner, None
        if not rest.startswith(":"):
            raise ConfigError(f"server.host: {host!r} is not [v6]:port")
        return inner, _port(rest[1:], host)
    if host.count(":") == 1:
        name, port = host.split(":")
        return name, _port(port, host)
    return host, None


def _port(text: str, whole: str) -> int:
    if not text.isdigit() or not 0 <= int(text) <= 65535:
        raise ConfigError(f"server.host: bad port in {whole!r}")
    return int(text)


def _check_cold_dir(data_dir: str, cold_dir: str) -> None:
    """The cold tier has its own `topics/` tree: it must not be, or overlap, the data
    directory (a relocation would copy a segment onto itself, then unlink it)."""
    if not cold_dir:
        return
    if not cold_dir.strip():
        raise ConfigError("storage.cold_dir: blank path (leave it empty for no cold tier)")
    data = os.path.abspath(data_dir)
    cold = os.path.abspath(cold_dir)
    if cold == data or cold.startswith(data + os.sep) or data.startswith(cold + os.sep):
        raise ConfigError(
            f"storage.cold_dir: {cold_dir!r} overlaps storage.data_dir {data_dir!r} (the "
            "cold tier needs a directory of its own)"
        )


def _post_process(cfg: Config, *, port_flag: bool = False) -> Config:
    host, port = split_host_port(cfg.server.host)
    if not host:
        raise ConfigError("server.host: empty host")
    if port is None or port_flag:  # a --port flag beats a port inside server.host
        port = cfg.server.port
    server = dataclasses.replace(cfg.server, host=host, port=port)
    if not cfg.storage.data_dir.strip():
        raise ConfigError("storage.data_dir: empty path")
    _check_cold_dir(cfg.storage.data_dir, cfg.storage.cold_dir)
    parse_log_level(cfg.logging.level)
    if cfg.queue.min_lease_ms > cfg.queue.max_lease_ms:
        raise ConfigError("queue.min_lease_ms: above queue.max_lease_ms")
    if cfg.queue.depth_retry_min_ms > cfg.queue.depth_retry_max_ms:
        raise ConfigError("queue.depth_retry_min_ms: above queue.depth_retry_max_ms")
    if cfg.scheduler.priority_min > cfg.scheduler.priority_max:
        raise ConfigError("scheduler.priority_min: above scheduler.priority_max")
    bounds = cfg.scheduler.band_thresholds
    if list(bounds) != sorted(bounds, reverse=True) or len(set(bounds)) != len(bounds):
        raise ConfigError("scheduler.band_thresholds: must be strictly decreasing")
    if any(w < 1 for w in cfg.scheduler.band_weights):
        raise ConfigError("scheduler.band_weights: every weight must be at least 1")
    p = cfg.protocol
    if p.default_limit > p.max_limit:
        raise ConfigError("protocol.default_limit: above protocol.max_limit")
    if p.default_max_batch_bytes > p.max_batch_bytes:
        raise ConfigError("protocol.default_max_batch_bytes: above protocol.max_batch_bytes")
    if p.default_page_size > p.max_page_size:
        raise ConfigError("protocol.default_page_size: above protocol.max_page_size")
    _check_dashboard(cfg.dashboard)
    _check_recoverable(cfg)
    _check_jetstream(cfg.storage)
    return dataclasses.replace(cfg, server=server)


_DASHBOARD_PATH: Final = re.compile(r"(/[A-Za-z0-9._~-]+)+")


def _check_dashboard(d: DashboardConfig) -> None:
    if not _DASHBOARD_PATH.fullmatch(d.path):
        raise ConfigError(
            f"dashboard.path: {d.path!r} is not an absolute path of plain segments "
            "(letters, digits, . _ ~ -; no trailing slash, no query)"
        )
    if d.path == "/v0" or d.path.startswith("/v0/") or d.path in ("/healthz", "/readyz"):
        raise ConfigError(f"dashboard.path: {d.path!r} would shadow an API route")
    if d.pressure_warn > d.pressure_pause:
        raise ConfigError("dashboard.pressure_warn: above dashboard.pressure_pause")
    if d.lag_warn > d.lag_pause:
        raise ConfigError("dashboard.lag_warn: above dashboard.lag_pause")
    if d.inflight_warn > d.inflight_pause:
        raise ConfigError("dashboard.inflight_warn: above dashboard.inflight_pause")


def record_frame_bound(p: ProtocolConfig) -> int:
    """The most bytes one record the protocol limits accept can need in a WAL frame.

    A write is split across frames at record boundaries, so a record is the unit that must
    fit one frame: its data+meta, its stored JSON around them (`$seq`, `$ts`, a node
    JSON-escaped up to 6 bytes per byte, `$priority`), and the frame's sparse extras (tag,
    node and idempotency key counted at up to 4 bytes per character), plus fixed headers.
    Generous on purpose; `tests/storage` encodes the worst case against it."""
    return (
        p.max_record_bytes
        + 11 * p.max_node_bytes
        + 4 * p.max_tag_bytes
        + 4 * p.max_idempotency_key_bytes
        + 1024
    )


def _check_recoverable(cfg: Config) -> None:
    """Refuse limits under which the server could acknowledge a write that recovery
    cannot read back (every other pair is safe by construction: docs/configuration.md)."""
    need = record_frame_bound(cfg.protocol)
    have = cfg.storage.wal.max_frame_bytes
    if need > have:
        raise ConfigError(
            f"storage.wal.max_frame_bytes: {have} is too small for one record the protocol "
            f"limits accept (up to {need} bytes framed: protocol.max_record_bytes "
            f"{cfg.protocol.max_record_bytes} plus node, tag, key and headers); raise it to "
            f"at least {need} or lower protocol.max_record_bytes"
        )


_JS_PREFIX = re.compile(r"[A-Za-z0-9_-]{1,32}")


def _check_jetstream(storage: StorageConfig) -> None:
    js = storage.jetstream
    if not _JS_PREFIX.fullmatch(js.prefix):
        raise ConfigError(
            f"storage.jetstream.prefix: {js.prefix!r} must be 1-32 letters, digits, '-' or '_'"
        )
    if storage.backend == "jetstream" and not any(url.strip() for url in js.servers):
        raise ConfigError("storage.jetstream.servers: the jetstream backend needs a server URL")
    if storage.backend == "jetstream" and storage.cold_dir:
        raise ConfigError(
            "storage.cold_dir: the cold tier is the embedded backend's; with storage.backend = "
            '"jetstream" remove it'
        )


def parse_log_level(text: str) -> tuple[str, dict[str, str]]:
    """`info` or `warn,topicd.http=debug` → (root level, {logger: level})."""
    root = "info"
    per: dict[str, str] = {}
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        if "=" in part:
            name, _, lvl = part.partition("=")
            lvl = lvl.strip().lower()
            if lvl not in LOG_LEVELS or not name.strip():
                raise ConfigError(f"logging.level: bad filter {part!r}")
            per[name.strip()] = lvl
        else:
            if part.lower() not in LOG_LEVELS:
                raise ConfigError(f"logging.level: {part!r} is not one of {', '.join(LOG_LEVELS)}")
            root = part.lower()
    return root, per


def is_loopback_host(host: str) -> bool:
    """True when `host` binds to loopback only (README §2.6)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        pass
    import socket

    try:
        infos = socket.getaddrinfo(host, None)
    except OSError:
        return False
    addrs = {info[4][0] for info in infos}
    return bool(addrs) and all(
        ipaddress.ip_address(str(a).split("%")[0]).is_loopback for a in addrs
    )


# --------------------------------------------------------------------------------------
# Printing (print-default-config, check-config --print, conf/topicd.toml)
# --------------------------------------------------------------------------------------


def _toml_value(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)
    if isinstance(value, tuple):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    raise AssertionError(f"cannot render {value!r}")


def render_toml(cfg: Config, *, redact: bool) -> str:
    """The whole tree as commented TOML (every key, its value, env names)."""
    lines = [
        "# topicd configuration. Every key is shown with its default and a one-line comment.",
        "# Precedence: flags > TOPICD_* env > legacy TOPICS_* env > this file > defaults.",
        "# Sizes are bytes, durations milliseconds. Unknown keys are an error.",
    ]
    _render_section(lines, cfg, "", redact)
    return "\n".join(lines) + "\n"


def _render_section(lines: list[str], obj: object, prefix: str, redact: bool) -> None:
    for f in _fields(type(obj)):
        value = getattr(obj, f.name)
        if "section" in f.metadata:
            lines.append("")
            lines.append(f"# {f.metadata['section']}")
            lines.append(f"[{prefix}{f.name}]")
            _render_section(lines, value, f"{prefix}{f.name}.", redact)
            continue
        if "tables" in f.metadata:
            assert isinstance(value, tuple)
            lines.append("")
            lines.append("# Pre-hashed keys (api-ops §5.3); `topicd hash-key` prints a digest:")
            if not value:
                lines.append(f"# [[{prefix}{f.name}]]")
                lines.append('# sha256 = "<64 hex chars>"')
                lines.append('# scopes = ["read"]')
                lines.append('# prefixes = ["tenant42:"]')
            for hk in value:
                assert isinstance(hk, HashedKey)
                lines.append(f"[[{prefix}{f.name}]]")
                lines.append(f"sha256 = {_toml_value(hk.sha256)}")
                lines.append(f"scopes = {_toml_value(hk.scopes)}")
                lines.append(f"prefixes = {_toml_value(hk.prefixes)}")
            continue
        spec = f.metadata["key"]
        assert isinstance(spec, KeySpec)
        path = prefix + f.name
        if redact and spec.secret and isinstance(value, tuple):
            value = tuple(_redact_entry(v) for v in value)
        lines.append(f"# {spec.comment} Env: {', '.join(env_names(path, spec))}.")
        lines.append(f"{f.name} = {_toml_value(value)}")


def markdown_table() -> str:
    """Every key as a Markdown table (embedded in docs/configuration.md; a test compares)."""
    rows = ["| Key | Default | Environment | Meaning |", "|---|---|---|---|"]

    def walk(obj: object, prefix: str) -> None:
        for f in _fields(type(obj)):
            value = getattr(obj, f.name)
            if "section" in f.metadata:
                walk(value, f"{prefix}{f.name}.")
                continue
            if "tables" in f.metadata:
                rows.append(f"| `[[{prefix}{f.name}]]` | — | — | Pre-hashed key tables. |")
                continue
            spec = f.metadata["key"]
            assert isinstance(spec, KeySpec)
            path = prefix + f.name
            env = ", ".join(f"`{e}`" for e in env_names(path, spec))
            comment = spec.comment.replace("|", "\\|")
            rows.append(f"| `{path}` | `{_toml_value(value)}` | {env} | {comment} |")

    walk(DEFAULT, "")
    return "\n".join(rows) + "\n"


def _redact_entry(entry: object) -> str:
    text = str(entry)
    _, sep, rest = text.partition(":")
    return "<redacted>" + (sep + rest if sep else "")


def contract_warnings(cfg: Config) -> list[str]:
    """Warnings for `check-config`: changed /v0 contract limits and risky switches."""
    out: list[str] = []
    for name in ("protocol", "watch", "queue"):
        current, default_section = getattr(cfg, name), getattr(DEFAULT, name)
        for f in _fields(type(current)):
            spec = f.metadata["key"]
            assert isinstance(spec, KeySpec)
            value, default = getattr(current, f.name), getattr(default_section, f.name)
            if spec.contract and value != default:
                out.append(
                    f"{name}.{f.name} = {value} differs from the /v0 contract default "
                    f"{default}; clients that rely on the documented value may break"
                )
    if cfg.auth.allow_insecure_no_auth:
        out.append(
            "auth.allow_insecure_no_auth is on: without keys anyone who can reach the port "
            "has full access"
        )
    if cfg.auth.api_keys or cfg.auth.key or cfg.auth.api_keys_file:
        out.append(
            "?token= on SSE URLs is a dev fallback: prefer the Authorization header "
            "(query strings leak into logs and history)"
        )
    return out


def check_paths(cfg: Config) -> None:
    """Validate directory paths without creating anything (for `check-config`)."""
    data_dir = Path(cfg.storage.data_dir)
    if data_dir.exists() and not data_dir.is_dir():
        raise ConfigError(f"storage.data_dir: {data_dir} exists and is not a directory")
    if not data_dir.exists():
        parent = next((p for p in data_dir.absolute().parents if p.exists()), None)
        if parent is None or not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK):
            raise ConfigError(f"storage.data_dir: {data_dir} cannot be created")
    if cfg.server.port_file:
        parent_dir = Path(cfg.server.port_file).absolute().parent
        if not parent_dir.is_dir():
            raise ConfigError(f"server.port_file: directory {parent_dir} does not exist")


def read_api_keys_file(auth: AuthConfig) -> list[str]:
    """Lines of `auth.api_keys_file` (read once at start-up, before the event loop runs)."""
    if not auth.api_keys_file:
        return []
    path = Path(auth.api_keys_file)
    try:
        return path.read_text("utf-8").splitlines()
    except OSError as exc:
        raise ConfigError(f"auth.api_keys_file: cannot read {path}: {exc.strerror}") from None


def hash_secret(secret: str) -> str:
    """SHA-256 hex digest of a bearer secret (the only form kept at rest)."""
    return hashlib.sha256(secret.encode("utf-8")).hexdigest()
