"""Tuning curves of a seeded and an unseeded session on one device, side by side.

    python bench/seeding_curves.py --model mobilenet_v2 --width 0.35 --resolution 64 \
        --classes 10 --batch 8 --target targets/h100_opencl.json \
        --seeded /tmp/tt/seeding/seeded --fresh /tmp/tt/seeding/fresh --out bench/results/NAME

Each session's log (``tools/gpu_tune.sh seeding`` makes them on one card) is read in the order
its records were measured; either session may be left out (one curve). The estimated step time
after n records is :func:`thomas_tune.benchmark.curve.tuning_curve`'s over the tasks ``tune``
extracts for the model (training and inference graphs): calls x the faster of each task's
default-schedule time and its best valid record among the first n (a failed trial counts as a
trial and changes nothing); the default times are the unseeded session's
(``default_latency.json`` of its log; the seeded session's where a task is missing there), so
both curves start from the same point. A seeded log's first records are its seeds (measured on
this device before the search; their count is in its ``seeded`` stats).

``--reference [LABEL=]LOG`` (repeatable): a tuning log of the same card whose final estimate is
a goal, such as a fully tuned log re-measured there (``SEED_REF`` of ``gpu_tune.sh seeding``:
``remeasure --restamp``) or a longer run; its final estimate, with the same default times, is
drawn as a line, and each session's records to 95% of its gain (untuned minus its estimate) are
counted. Without one the goal is to come within 5% of the unseeded session's final estimate.
Each session's records to 95% of its own final gain are given too. Writes ``OUT.json`` (the
curves, the finals, the goals and the records each session took to reach them) and
``OUT.png``. Times in ms.
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


def to_share_of_gain(ms: list[float], final: float, share: float = 0.95) -> int | None:
    """The fewest records after which ``ms`` (ms[0]: the untuned estimate) has ``share`` of the
    gain from ms[0] down to ``final``; None when it never gets there or there is no gain."""
    if not ms or ms[0] <= final:
        return None
    return first_within(ms, ms[0] - share * (ms[0] - final))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_args(ap)
    ap.add_argument("--target", default="targets/h100_opencl.json")
    ap.add_argument("--seeded", help="the seeded session's tuning log")
    ap.add_argument("--fresh", help="the unseeded session's tuning log")
    ap.add_argument("--reference", action="append", default=[], metavar="[LABEL=]LOG",
                    help="a tuning log of the same card (a fully tuned log re-measured there, "
                    "a longer run) whose final estimate is a goal: 95%% of its gain; repeatable")
    ap.add_argument("--seeds", type=int, help="seed records at the head of the seeded log "
                    "(default: 'seeded.measured' of seeded.stats.json beside it)")
    ap.add_argument("--out", required=True, help="path prefix of OUT.json and OUT.png")
    a = ap.parse_args()
    sessions = [(n, p) for n, p in (("seeded", a.seeded), ("fresh", a.fresh)) if p]
    if not sessions:
        ap.error("give --seeded, --fresh or both")
    model, _, _ = load_model(a)
    default_s: dict[str, float] = {}
    for _, log in sessions:  # the unseeded session's times win (it comes last)
        path = os.path.join(log, "default_latency.json")
        if os.path.exists(path):
            default_s.update(json.load(open(path))["seconds"])
    if not default_s:
        raise SystemExit("no default_latency.json in the sessions' logs: tune with "
                         "--time-share (or any tune run) writes it")
    # the tasks tune extracts, each with its calls and default time (ms)
    tasks = extract(model_graphs(a, model), parse_target(a.target))
    kernels = [Kernel(t.name, t.weight, t.flops, 0, key(t),
                      ms={"default": default_s[key(t)] * 1e3})
               for t in tasks if key(t) in default_s]
    curves = {name: tuning_curve(log, kernels)["ms"] for name, log in sessions}
    untuned = next(iter(curves.values()))[0]
    result = {"untuned_ms": untuned, "kernels": len(kernels), "tasks": len(tasks)}
    goals = []  # (label, final estimate or None, goal), in ms
    for i, spec in enumerate(a.reference):
        label, _, path = spec.rpartition("=")
        label = label or ("reference" if len(a.reference) == 1 else f"reference {i + 1}")
        ref = tuning_curve(path, kernels)
        final = ref["ms"][-1]
        goals.append((label, final, untuned - 0.95 * (untuned - final)))
        result.setdefault("references", []).append(
            {"label": label, "log": path, "final_ms": final, "records": len(ref["ms"]) - 1,
             "skipped_records": ref["skipped_records"], "goal_ms": goals[-1][2],
             "goal": f"95% of the gain of {label}"})
    if not goals:
        final_name = "fresh" if "fresh" in curves else "seeded"
        goals.append((f"within 5% of the {final_name} final", None,
                      curves[final_name][-1] / 0.95))
        result["goal_ms"], result["goal"] = goals[0][2], goals[0][0]
    for name, c in curves.items():
        result[name] = {"records": len(c) - 1, "final_ms": c[-1],
                        "records_to_goal": {label: first_within(c, goal)
                                            for label, _, goal in goals},
                        "records_to_95pct_of_own_gain": to_share_of_gain(c, c[-1])}
    if "seeded" in curves:
        stats_path = os.path.join(os.path.dirname(a.seeded.rstrip("/")), "seeded.stats.json")
        seeds = a.seeds if a.seeds is not None else \
            (json.load(open(stats_path)).get("seeded") or {}).get("measured") \
            if os.path.exists(stats_path) else None
        result["seeded"].update(
            seeds=seeds, after_seeds_ms=curves["seeded"][seeds]
            if seeds is not None and seeds < len(curves["seeded"]) else None)
    result["curves"] = curves
    with open(a.out + ".json", "w") as f:
        json.dump(result, f, indent=1)
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4))
    for name, c in curves.items():
        ax.plot(range(len(c)), c, label=f"{name} ({len(c) - 1} records)")
    for i, (label, final, goal) in enumerate(goals):
        color = ("black", "tab:red", "tab:green", "tab:purple")[i % 4]
        if final is None:
            ax.axhline(goal, color="grey", ls=":", label=label)
            continue
        ax.axhline(final, color=color, ls="--", lw=1, label=f"{label}: {final:.2f} ms")
        ax.axhline(goal, color=color, ls=":", lw=1, label=f"95% of its gain: {goal:.2f} ms")
    ax.set_xlabel("records measured on this device (trials, seeds included)")
    ax.set_ylabel("estimated step time, ms")
    what = " vs ".join({"seeded": "seeded", "fresh": "from nothing"}[n] for n in curves)
    ax.set_title(f"{model.arch} {model.width:g}@{model.resolution} batch {a.batch}: {what}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(a.out + ".png", dpi=120)
    print(json.dumps({k: v for k, v in result.items() if k != "curves"}, indent=1))


if __name__ == "__main__":
    main()
