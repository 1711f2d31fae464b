"""Tuning curves of a seeded and an unseeded session on one device, side by side.

    python bench/seeding_curves.py --model mobilenet_v2 --width 0.35 --resolution 64 \
        --classes 10 --batch 8 --target targets/h100_opencl.json \
        --seeded /tmp/tt/seeding/seeded --fresh /tmp/tt/seeding/fresh --out bench/results/NAME

Each session's log (``tools/gpu_tune.sh seeding`` makes both on one card) is read in the order
its records were measured. The estimated step time after n records is
:func:`thomas_tune.benchmark.curve.tuning_curve`'s over the tasks ``tune`` extracts for the
model (training and inference graphs): calls x the faster of each task's default-schedule time
and its best valid record among the first n (a failed trial counts as a trial and changes
nothing); the default times are the unseeded session's
(``default_latency.json`` of its log; the seeded session's where a task is missing there), so
both curves start from the same point. A seeded log's first records are its seeds (measured on
this device before the search; their count is in its ``seeded`` stats). Writes
``OUT.json`` (both curves, the unseeded session's final estimate, the records each session took
to come within 5% of it) and ``OUT.png``. Times in ms.
"""

from __future__ import annotations

import argparse
import json
import os

from thomas_tune.benchmark.curve import tuning_curve
from thomas_tune.benchmark.kernels import Kernel
from thomas_tune.cli.options import add_model_args, load_model, model_graphs
from thomas_tune.target import parse_target
from thomas_tune.tasks import extract, key


def first_within(ms: list[float], goal: float) -> int | None:
    """The fewest records after which the estimate is at most ``goal``."""
    return next((i for i, v in enumerate(ms) if v <= goal), None)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_args(ap)
    ap.add_argument("--target", default="targets/h100_opencl.json")
    ap.add_argument("--seeded", required=True)
    ap.add_argument("--fresh", required=True)
    ap.add_argument("--out", required=True, help="path prefix of OUT.json and OUT.png")
    a = ap.parse_args()
    model, _, _ = load_model(a)
    default_s: dict[str, float] = {}
    for log in (a.seeded, a.fresh):  # the unseeded session's times win
        path = os.path.join(log, "default_latency.json")
        if os.path.exists(path):
            default_s.update(json.load(open(path))["seconds"])
    # the tasks tune extracts, each with its calls and default time (ms)
    tasks = extract(model_graphs(a, model), parse_target(a.target))
    kernels = [Kernel(t.name, t.weight, t.flops, 0, key(t),
                      ms={"default": default_s[key(t)] * 1e3})
               for t in tasks if key(t) in default_s]
    curves = {name: tuning_curve(log, kernels)["ms"]
              for name, log in (("seeded", a.seeded), ("fresh", a.fresh))}
    final = curves["fresh"][-1]
    goal = final / 0.95  # within 5% of the unseeded session's final estimate
    stats_path = os.path.join(os.path.dirname(a.seeded), "seeded.stats.json")
    seeds = (json.load(open(stats_path)).get("seeded") or {}).get("measured") \
        if os.path.exists(stats_path) else None
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
    ax.set_title(f"{model.arch} {model.width:g}@{model.resolution} batch {a.batch}: "
                 "seeded vs from nothing")
    ax.legend()
    fig.tight_layout()
    fig.savefig(a.out + ".png", dpi=120)
    print(json.dumps({k: v for k, v in result.items() if k != "curves"}, indent=1))


if __name__ == "__main__":
    main()
