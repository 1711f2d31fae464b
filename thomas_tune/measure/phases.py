"""Wall-time counters of the builder and the runner: where a tuning run's time went."""

from __future__ import annotations

import collections
import threading
from dataclasses import dataclass, field


@dataclass
class Phases:
    """Seconds spent per phase, summed over workers (``busy``) or as wall time (``wall``)."""

    wall: dict[str, float] = field(default_factory=lambda: collections.defaultdict(float))
    busy: dict[str, float] = field(default_factory=lambda: collections.defaultdict(float))
    counts: dict[str, int] = field(default_factory=lambda: collections.defaultdict(int))
    lanes: int = 1  # device servers measuring at once (the runner sets it)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, name: str, seconds: float, wall: bool = False, n: int = 1) -> None:
        with self.lock:
            (self.wall if wall else self.busy)[name] += seconds
            self.counts[name] += n

    def as_dict(self) -> dict:
        with self.lock:
            return {"wall_s": {k: round(v, 3) for k, v in self.wall.items()},
                    "busy_s": {k: round(v, 3) for k, v in self.busy.items()},
                    "counts": dict(self.counts), "lanes": self.lanes}
