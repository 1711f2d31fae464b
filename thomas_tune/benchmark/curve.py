"""The tuning curve: a training step's estimated kernel time against tuning trials."""

from __future__ import annotations

import json
import math
import sys

from .kernels import Kernel


def tuning_curve(log_path: str, kernels: list[Kernel], default_variant: str = "default") -> dict:
    """Estimated kernel time of a training step (ms) against trials of the tuning log.

    Records are read in file order (the order they were measured). Each workload of the step
    starts at its default-schedule time (``kernel.ms[default_variant]``); a valid record (run
    time below 1e9 s) replaces it when faster. Estimated step = sum over kernels of calls x
    time. Records of workloads not in this step are skipped (counted). Returns ``{"trials":
    [...], "ms": [...], "skipped_records": n, "trials_to_95pct": n or None}`` where
    ``trials_to_95pct`` is the first trial count whose estimate is within 5% of the total gain
    from the final value. Raises FileNotFoundError when the log has no record file.
    """
    from ..logs import TuningLog
    log = TuningLog(log_path)  # a packed log is read from its unpacked copy
    by_key: dict[str, list[Kernel]] = {}
    for k in kernels:
        by_key.setdefault(k.key, []).append(k)
    with open(log.workload_path) as f:
        wl_keys = []
        for line in f:
            try:
                wl_keys.append(str(int(json.loads(line)[0])))
            except (ValueError, IndexError, TypeError):
                wl_keys.append(None)
    cur = {key: ks[0].ms.get(default_variant, math.nan) for key, ks in by_key.items()}
    calls = {key: sum(k.calls for k in ks) for key, ks in by_key.items()}

    def total():
        return sum(cur[key] * calls[key] for key in cur if math.isfinite(cur[key]))

    trials, ms, skipped = [0], [total()], 0
    with open(log.record_path) as f:
        for line in f:
            try:
                idx, rec = json.loads(line)
                key = wl_keys[idx]
                secs = [float(s) for s in rec[1]]
            except (ValueError, IndexError, TypeError):
                skipped += 1
                continue
            if key not in cur or not math.isfinite(cur[key]):
                skipped += 1  # another graph's workload, or a kernel that was not timed
                continue
            t = sum(secs) / len(secs) * 1e3 if secs else math.inf
            if t < 1e12 and (not math.isfinite(cur[key]) or t < cur[key]):
                cur[key] = t
            trials.append(trials[-1] + 1)
            ms.append(total())
    first, last = ms[0], ms[-1]
    to95 = None
    if len(ms) > 1 and first > last:
        to95 = next(n for n, v in zip(trials, ms) if v - last <= 0.05 * (first - last))
    return {"trials": trials, "ms": ms, "skipped_records": skipped, "trials_to_95pct": to95}


def plot_curve(curve: dict, path: str, title: str) -> str | None:
    """Write the tuning curve as a PNG; returns None (and says why on stderr) when matplotlib
    is not installed (``pip install 'thomas_tune[bench]'``)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("bench: matplotlib is not installed; no tuning-curve PNG (the curve is in the "
              "JSON; pip install matplotlib to plot it)", file=sys.stderr)
        return None
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(curve["trials"], curve["ms"], drawstyle="steps-post")
    ax.set_xlabel("trials (tuning-log records in order)")
    ax.set_ylabel("estimated kernel time per training step (ms)")
    ax.set_title(title, fontsize=9)
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
