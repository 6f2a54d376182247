"""A sans-IO Server-Sent-Events parser (the EventSource rules): feed bytes, get events.

Blocks end at a blank line; `event:`, `data:` (joined with newlines), `id:` and `retry:`
fields; lines starting with `:` are comments (topicd heartbeats). Both `\\n` and `\\r\\n`
line ends are accepted. An unknown field is ignored, as the standard says.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SseEvent:
    event: str | None = None
    data: str | None = None
    id: str | None = None
    retry_ms: int | None = None
    comments: list[str] = field(default_factory=list)


class SseParser:
    """Incremental parser; bounded by the caller (one frame is at most the server's
    per-frame byte budget plus its framing)."""

    def __init__(self) -> None:
        self._buf = bytearray()

    def feed(self, chunk: bytes) -> list[SseEvent]:
        self._buf += chunk
        out: list[SseEvent] = []
        while True:
            end, sep = self._block_end()
            if end < 0:
                return out
            block = bytes(self._buf[:end]).decode("utf-8", "replace")
            del self._buf[: end + sep]
            out.append(self._parse(block))

    def _block_end(self) -> tuple[int, int]:
        a = self._buf.find(b"\n\n")
        b = self._buf.find(b"\r\n\r\n")
        if b >= 0 and (a < 0 or b < a):
            return b, 4
        return a, 2

    @staticmethod
    def _parse(block: str) -> SseEvent:
        ev = SseEvent()
        data: list[str] = []
        for line in block.replace("\r\n", "\n").split("\n"):
            if line.startswith(":"):
                ev.comments.append(line[1:].strip())
                continue
            name, _, value = line.partition(":")
            value = value.removeprefix(" ")
            if name == "event":
                ev.event = value
            elif name == "data":
                data.append(value)
            elif name == "id":
                ev.id = value
            elif name == "retry" and value.isdigit():
                ev.retry_ms = int(value)
        if data:
            ev.data = "\n".join(data)
        return ev
