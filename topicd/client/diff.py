"""`DiffReader`: a topic read from a cursor as an async iterator of events.

Each page is one `POST /v0/topics/:t/diff` (a read: retried like any safe request). A
page's tombstone is handed out before its records, as a `Tombstone` event, never skipped.
The reader follows `next_from_seq`, so records the server passed over (deleted, expired,
filtered by node) still move the cursor; it stops at `caught_up`, or with `follow=True`
long-polls (`wait_ms`) for the next append and never stops.

`cursor` is the position after the last event handed out: after a record its `$seq`,
after a tombstone its `gap_to` (for a recreated topic: just below the new instance's
first record), after a page's last event the page's `next_from_seq`.
Persisting it and starting a new reader there resumes exactly.
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING

import msgspec

from topicd.client.errors import ProtocolError
from topicd.client.models import Event, Record, Tombstone

if TYPE_CHECKING:
    from collections.abc import Sequence

    from topicd.client._client import Client


class _DiffWire(msgspec.Struct):
    records: list[msgspec.Raw]
    next_from_seq: int
    head_seq: int
    caught_up: bool
    tombstone: msgspec.Raw = msgspec.Raw(b"null")


_DIFF = msgspec.json.Decoder(_DiffWire)


class DiffReader:
    """See the module docstring. Build it with `Client.diff`."""

    def __init__(
        self,
        client: Client,
        topic: str,
        from_seq: int,
        *,
        follow: bool,
        limit: int,
        node: str | Sequence[str] | None,
        include_tags: bool,
        include_meta: bool,
        wait_ms: int,
    ) -> None:
        self.client = client
        self.topic = topic
        self.cursor = from_seq
        self.follow = follow
        self.head_seq: int | None = None
        self.caught_up = False
        self._body: dict[str, object] = {"include_tags": include_tags, "include_meta": include_meta}
        if limit:
            self._body["limit"] = limit
        if node is not None:
            self._body["node"] = node if isinstance(node, str) else list(node)
        self._wait_ms = wait_ms
        # each pending event with the cursor it leaves behind once handed out
        self._pending: deque[tuple[Event, int]] = deque()
        self._page_end: int | None = None

    def __aiter__(self) -> DiffReader:
        return self

    async def __anext__(self) -> Event:
        while not self._pending:
            if self._page_end is not None:
                self.cursor = self._page_end
                self._page_end = None
            if self.caught_up and not self.follow:
                raise StopAsyncIteration
            await self._fetch()
        event, cursor = self._pending.popleft()
        self.cursor = cursor
        if not self._pending and self._page_end is not None:
            self.cursor = self._page_end
            self._page_end = None
        return event

    async def _fetch(self) -> None:
        body = dict(self._body, from_seq=self.cursor)
        if self.follow and self.caught_up:
            body["wait_ms"] = self._wait_ms
        resp = await self.client._request(
            "POST", f"/v0/topics/{self.topic}/diff", body=body, safe=True
        )
        try:
            page = _DIFF.decode(resp.content)
            tomb = msgspec.json.decode(page.tombstone)
        except msgspec.DecodeError as exc:
            raise ProtocolError(f"diff {self.topic}: {exc}") from None
        if tomb is not None:
            if not isinstance(tomb, dict):
                raise ProtocolError(f"diff {self.topic}: tombstone is not an object")
            t = Tombstone.from_json(self.topic, tomb)
            self._pending.append((t, t.resume_after))
        for raw in page.records:
            rec = Record.decode(self.topic, bytes(raw))
            self._pending.append((rec, rec.seq))
        self.head_seq = page.head_seq
        self.caught_up = page.caught_up
        if self._pending:
            self._page_end = page.next_from_seq
        else:
            self.cursor = page.next_from_seq
