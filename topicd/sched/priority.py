"""Effective priority of a topic (scheduler spec A.5, B.3), in integer fixed point.

`auto(dt_ms)` is the recency term `500 · 2^(−dt/30000)` with the 5-minute floor, computed
from a 64-entry table of `2^(−i/64)` scaled by 2^16, so the hot path is two shifts and a
table lookup (no float `pow`). The spec's decay points (0 s → 500, 15 s → 354, 30 s → 250,
60 s → 125, 120 s → 31, ≥ 300 s → 0) come out exact; elsewhere the result is within 2 %
of the exact curve (±1 below 50).
"""

from __future__ import annotations

from typing import Final

AUTO_MAX: Final = 500
HALF_LIFE_MS: Final = 30000
FLOOR_MS: Final = 300000

_LUT: Final = tuple(round(AUTO_MAX * 65536 * 2 ** (-i / 64)) for i in range(64))


def auto(dt_ms: int, half_life_ms: int = HALF_LIFE_MS, floor_ms: int = FLOOR_MS) -> int:
    """Recency bonus for a topic last read `dt_ms` ago (0 once `dt_ms ≥ floor_ms`)."""
    if dt_ms >= floor_ms:
        return 0
    if dt_ms < 0:
        dt_ms = 0
    q = dt_ms * 64 // half_life_ms
    n = q >> 6
    return ((_LUT[q & 63] >> n) + 32768) >> 16


def base_priority(
    priority: int | None,
    auto_priority: bool,
    last_read_ms: int | None,
    now_ms: int,
    priority_min: int = -1000,
    priority_max: int = 1000,
) -> int:
    """`base` of A.5: manual priority (clamped), else the recency term, else 0."""
    if priority is not None:
        return min(max(priority, priority_min), priority_max)
    if not auto_priority or last_read_ms is None:
        return 0
    return auto(now_ms - last_read_ms)
