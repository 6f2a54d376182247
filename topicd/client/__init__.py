"""The topicd client: an async client (Trio or asyncio, over `httpx` with keep-alive), a
blocking facade, typed errors and graduated producer backpressure.

    from topicd.client import Client

    async with Client("http://127.0.0.1:4000") as client:
        await client.write("events", {"hello": "world"})
        async for event in client.diff("events"):
            ...

See `docs/client.md` for the whole contract.
"""

from topicd.client._client import AUTO, DEFAULT_URL, Client
from topicd.client.backpressure import (
    PAUSE,
    BackpressurePolicy,
    Clock,
    LoopClock,
    ZoneReport,
    delay_ms,
)
from topicd.client.diff import DiffReader
from topicd.client.errors import (
    BackpressureTimeout,
    BatchTooLarge,
    CapacityError,
    ClientError,
    ConnectionFailed,
    Forbidden,
    Internal,
    InvalidRequest,
    MethodNotAllowed,
    NotAcceptable,
    NotAQueue,
    NotFound,
    NotReady,
    PayloadTooLarge,
    ProtocolError,
    RecordTooLarge,
    RouterCycle,
    RouterNotFound,
    ServerError,
    ShuttingDown,
    StorageUnavailable,
    Throttled,
    TopicExistsIncompatible,
    TopicFull,
    TopicNotEmpty,
    TopicNotFound,
    Unauthorized,
    Unavailable,
    UnsupportedMediaType,
    WatchSuperseded,
)
from topicd.client.models import (
    CaughtUp,
    Event,
    Job,
    LeaseResult,
    PushPaused,
    Record,
    Tombstone,
    TopicDeleted,
    WriteResult,
)
from topicd.client.sync import SyncClient
from topicd.client.watch import WatchStream
from topicd.client.worker import WorkerStats, run_worker

__all__ = [
    "AUTO",
    "DEFAULT_URL",
    "PAUSE",
    "BackpressurePolicy",
    "BackpressureTimeout",
    "BatchTooLarge",
    "CapacityError",
    "CaughtUp",
    "Client",
    "ClientError",
    "Clock",
    "ConnectionFailed",
    "DiffReader",
    "Event",
    "Forbidden",
    "Internal",
    "InvalidRequest",
    "Job",
    "LeaseResult",
    "LoopClock",
    "MethodNotAllowed",
    "NotAQueue",
    "NotAcceptable",
    "NotFound",
    "NotReady",
    "PayloadTooLarge",
    "ProtocolError",
    "PushPaused",
    "Record",
    "RecordTooLarge",
    "RouterCycle",
    "RouterNotFound",
    "ServerError",
    "ShuttingDown",
    "StorageUnavailable",
    "SyncClient",
    "Throttled",
    "Tombstone",
    "TopicDeleted",
    "TopicExistsIncompatible",
    "TopicFull",
    "TopicNotEmpty",
    "TopicNotFound",
    "Unauthorized",
    "Unavailable",
    "UnsupportedMediaType",
    "WatchStream",
    "WatchSuperseded",
    "WorkerStats",
    "WriteResult",
    "ZoneReport",
    "delay_ms",
    "run_worker",
]
