"""Tuning curves of a seeded and an unseeded session on one device, side by side.

    python bench/seeding_curves.py --arch mobilenet_v2 --width 0.35 --resolution 64 \
        --classes 10 --batch 8 --target targets/h100_opencl.json \
        --seeded /tmp/tt/seeding/seeded --fresh /tmp/tt/seeding/fresh --out bench/results/NAME

Each session's log (``tools/gpu_tune.sh seeding`` makes both on one card) is read in the order
its records were measured. The estimated step time after n records is the sum over the
model's tasks (training and inference graphs) of calls x the faster of the task's
default-schedule time and its best valid record among the first n (a failed trial counts as a
trial and changes nothing); the default times are the unseeded session's
(``default_latency.json`` of its log; the seeded session's where a task is missing there), so
both curves start from the same point. A seeded log's first records are its seeds (measured on
this device before the search; their count is in its ``seeded`` stats). Writes
``OUT.json`` (both curves, the unseeded session's final estimate, the records each session took
to come within 5% of it) and ``OUT.png``. Times in ms.
"""

from __future__ import annotations

import argparse
import json
import math
import os

from thomas_tune import graph as G
from thomas_tune.logs.database import mean_run_seconds
from thomas_tune.logs.reading import read_log
from thomas_tune.models import build
from thomas_tune.target import parse_target
from thomas_tune.tasks import extract, key


def curve(log_dir: str, weights: dict[str, int], default_s: dict[str, float]) -> list[float]:
    """Estimated step ms after 0, 1, ..., n records of ``log_dir`` (module docstring)."""
    contents = read_log(log_dir)
    best = {k: s for k, s in default_s.items() if k in weights and math.isfinite(s)}

    def total():
        return sum(weights[k] * s for k, s in best.items()) * 1e3

    out = [total()]
    for wl, body in contents.records:
        k = str(contents.workloads[wl][1])
        s = mean_run_seconds(body[1])
        if k in best and math.isfinite(s) and 0 < s < best[k]:
            best[k] = s
        out.append(total())
    return out


def first_within(ms: list[float], goal: float) -> int | None:
    """The fewest records after which the estimate is at most ``goal``."""
    return next((i for i, v in enumerate(ms) if v <= goal), None)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", default="mobilenet_v2")
    ap.add_argument("--width", type=float, default=0.35)
    ap.add_argument("--resolution", type=int, default=64)
    ap.add_argument("--classes", type=int, default=10)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--trainable", default="all")
    ap.add_argument("--target", default="targets/h100_opencl.json")
    ap.add_argument("--seeded", required=True)
    ap.add_argument("--fresh", required=True)
    ap.add_argument("--out", required=True, help="path prefix of OUT.json and OUT.png")
    a = ap.parse_args()
    model = build(a.arch, width=a.width, resolution=a.resolution, num_classes=a.classes)
    graphs = {"infer": G.inference_module(model, 1),
              "train": G.training_module(model, a.batch, a.trainable).mod}
    weights = {key(t): t.weight for t in extract(graphs, parse_target(a.target))}
    default_s: dict[str, float] = {}
    for log in (a.seeded, a.fresh):  # the unseeded session's times win
        path = os.path.join(log, "default_latency.json")
        if os.path.exists(path):
            default_s.update(json.load(open(path))["seconds"])
    curves = {"seeded": curve(a.seeded, weights, default_s),
              "fresh": curve(a.fresh, weights, default_s)}
    final = curves["fresh"][-1]
    goal = final / 0.95  # within 5% of the unseeded session's final estimate
    stats = {}
    for name, log in (("seeded", a.seeded), ("fresh", a.fresh)):
        path = os.path.join(os.path.dirname(log), f"{name}.stats.json")
        stats[name] = json.load(open(path)) if os.path.exists(path) else {}
    seeds = int(stats["seeded"].get("seeded", {}).get("measured", 0) or 0) \
        if isinstance(stats["seeded"].get("seeded"), dict) else None
    result = {
        "untuned_ms": curves["fresh"][0], "fresh_final_ms": final,
        "fresh_records": len(curves["fresh"]) - 1, "seeded_records": len(curves["seeded"]) - 1,
        "seeded_after_seeds_ms": curves["seeded"][seeds] if seeds is not None
        and seeds < len(curves["seeded"]) else None, "seeds": seeds,
        "records_to_95pct_of_fresh_final": {n: first_within(c, goal) for n, c in curves.items()},
        "curves": curves}
    with open(a.out + ".json", "w") as f:
        json.dump(result, f, indent=1)
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4))
    for name, c in curves.items():
        ax.plot(range(len(c)), c, label=f"{name} ({len(c) - 1} records)")
    ax.axhline(goal, color="grey", ls=":", label="within 5% of the unseeded final")
    ax.set_xlabel("records measured on this device (trials, seeds included)")
    ax.set_ylabel("estimated step time, ms")
    ax.set_title(f"{a.arch} {a.width:g}@{a.resolution} batch {a.batch}: seeded vs from nothing")
    ax.legend()
    fig.tight_layout()
    fig.savefig(a.out + ".png", dpi=120)
    print(json.dumps({k: v for k, v in result.items() if k != "curves"}, indent=1))


if __name__ == "__main__":
    main()
