"""The backstop's rules (pure): which processes a container over its limit loses,
and what a lowered limit leaves it.

The memory service applies them to `cgpu_km.dataplane.attribution`'s figures;
the plane stops the chosen processes (`cgpu_km.dataplane.stopping`).
"""

from __future__ import annotations

from collections.abc import Mapping

from cgpu_km.tree.views import Key


def over_limit(procs: Mapping[int, int], limit: int) -> list[int]:
    """The processes to stop so that the rest fit in `limit` (largest first); [] if within."""
    if limit <= 0:
        return []
    total = sum(procs.values())
    chosen: list[int] = []
    for pid, size in sorted(procs.items(), key=lambda item: (-item[1], item[0])):
        if total <= limit:
            break
        chosen.append(pid)
        total -= size
    return chosen


class Grandfather:
    """What a lowered limit leaves a container (cGPU mode): what it held when the
    limit went below it, until its use falls under the new limit."""

    def __init__(self) -> None:
        self._held: dict[Key, int] = {}

    def limit(self, key: Key, limit: int, usage: int, lowered: bool) -> int:
        """The limit the backstop enforces now. `lowered`: the operator just set
        `limit` below what the container had (its use is `usage`)."""
        if limit <= 0:
            self._held.pop(key, None)
            return limit
        if lowered and usage > limit:
            self._held[key] = max(self._held.get(key, 0), usage)
        held = self._held.get(key)
        if held is None:
            return limit
        if usage <= limit:
            del self._held[key]
            return limit
        return held

    def forget(self, keep: set[Key]) -> None:
        for key in set(self._held) - keep:
            del self._held[key]
