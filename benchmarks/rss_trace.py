"""A process's resident memory sampled at a fixed interval while a benchmark runs, its trend, and its plot.

The soak (`benchmarks/soak.py --minutes 30`) samples the server every 10 s. Flat means the least-squares slope
of the samples after warm-up, as a share of their mean, is under 1% per 10 minutes.
"""

from __future__ import annotations

import threading
import time
from typing import Callable


class RssTrace(threading.Thread):
    """Samples `read()` (MB) every `every` seconds from start() until stop(): `samples` [(seconds, MB)]."""

    def __init__(self, read: Callable[[], float], every: float = 10.0):
        super().__init__(name="rss-trace", daemon=True)
        self.read, self.every = read, every
        self.samples: list[tuple[float, float]] = []
        self.done = threading.Event()

    def run(self) -> None:
        start = time.monotonic()
        while True:
            self.samples.append((round(time.monotonic() - start, 1), round(self.read(), 1)))
            if self.done.wait(self.every):
                return

    def stop(self) -> list[tuple[float, float]]:
        self.done.set()
        self.join()
        return self.samples


def slope_pct_per_10min(samples: list[tuple[float, float]]) -> float:
    """Least-squares slope of the samples in percent of their mean per 10 minutes (0 for fewer than 3)."""
    if len(samples) < 3:
        return 0.0
    n = len(samples)
    mt = sum(t for t, _ in samples) / n
    mm = sum(m for _, m in samples) / n
    var = sum((t - mt) ** 2 for t, _ in samples)
    slope = sum((t - mt) * (m - mm) for t, m in samples) / var if var else 0.0  # MB per second
    return 100 * slope * 600 / mm


def plot(samples: list[tuple[float, float]], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3))
    ax.plot([t / 60 for t, _ in samples], [m for _, m in samples], lw=1.2)
    ax.set_xlabel("minutes of traffic")
    ax.set_ylabel("server RSS (MB)")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
