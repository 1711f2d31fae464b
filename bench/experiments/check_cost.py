"""What checking every candidate's outputs costs the tuner: trials/s with and without.

Tunes the same tasks from empty tuning logs, with the same seed and budget, over a loopback
tracker and device servers of this machine's OpenCL device: once with the check
(``tune(check=True)``, the product's behaviour) and once without, in ``--rounds`` rounds of
one run each way. Each round has a search seed of its own (both its runs draw the same
candidates), and the order alternates (checked first in the odd rounds, unchecked first in the
even ones): the second run of a round finds the OpenCL driver's program cache warm with the
first run's kernels, which favours whichever goes second. Prints one JSON line per run (trials,
seconds, trials/s, wrong results, the device-side seconds of the check, of the reference
set-ups and of loading the references' libraries), each round's ratio, and their median,
smallest and largest.

    python3 bench/experiments/check_cost.py [--model mobilenet_v2] [--width 0.35] [--resolution 64]
        [--batch 8] [--top 6] [--trials 48] [--servers 2] [--rounds 4] [--target JSON]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile


def task_args(description: str) -> argparse.ArgumentParser:
    """The options that pick the tasks of :func:`largest_tasks` (this script's and
    ``reference_setup_cost.py``'s)."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--model", default="mobilenet_v2")
    p.add_argument("--width", type=float, default=0.35)
    p.add_argument("--resolution", type=int, default=64)
    p.add_argument("--classes", type=int, default=10)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--top", type=int, default=6, help="the largest tasks of the training step")
    p.add_argument("--target", help="target JSON file (default: this machine's OpenCL device)")
    return p


def largest_tasks(args):
    """(target, the ``--top`` tasks of the model's training step with the most FLOPs)."""
    from thomas_tune.training_graph import graph as G
    from thomas_tune import opencl
    from thomas_tune.models import build
    from thomas_tune.target import parse_target
    from thomas_tune.tasks import extract
    target = parse_target(args.target) if args.target else opencl.target_for(0)
    model = build(args.model, num_classes=args.classes, resolution=args.resolution,
                  width=args.width)
    graph = G.training_module(model, args.batch, "all").mod
    return target, sorted(extract({"train": graph}, target),
                          key=lambda t: -t.total_flops)[:args.top]


def main() -> None:
    p = task_args(__doc__.splitlines()[0])
    p.add_argument("--trials", type=int, default=48)
    p.add_argument("--servers", type=int, default=2)
    p.add_argument("--rounds", type=int, default=4)
    args = p.parse_args()

    from thomas_tune import rpc
    from thomas_tune.tuning import rpc_runner, tune
    from thomas_tune.logs import TuningLog
    target, tasks = largest_tasks(args)
    ratios = []
    with rpc.loopback(key="check-cost", servers=args.servers, lifetime=3600) as addr:
        for r in range(args.rounds):
            runs = {}
            for check in ((True, False) if r % 2 == 0 else (False, True)):
                folder = tempfile.mkdtemp(prefix="thomas-tune-check-cost-")
                log = TuningLog(os.path.join(folder, "log"))
                report = tune(tasks, target, log, rpc_runner(addr, "check-cost"),
                              trials=args.trials, trials_per_iter=8, population=32,
                              show_progress=False, check=check, refine_top=0, seed=1000 * r)
                busy = report.phases.get("busy_s", {})
                runs[check] = row = {
                    "round": r, "check": check, "trials": report.trials,
                    "seconds": round(report.elapsed_s, 1),
                    "trials_per_s": round(report.trials_per_s, 4), "wrong": report.wrong,
                    "device_check_s": round(busy.get("run.check", 0.0), 2),
                    # set-ups under the device lock (inputs, reference run) and, outside it,
                    # the reference library's upload and the driver's build of its programs
                    "device_reference_s": round(busy.get("run.reference", 0.0), 2),
                    "reference_load_s": round(busy.get("run.reference_load", 0.0), 2),
                    "host_references_s": round(report.phases.get("wall_s", {}).get(
                        "references", 0.0), 1)}
                print(json.dumps(row), flush=True)
            ratios.append(runs[True]["trials_per_s"] / runs[False]["trials_per_s"])
            print(json.dumps({"round": r, "checked_first": r % 2 == 0,
                              "ratio": round(ratios[-1], 3)}), flush=True)
    print(json.dumps({"trials_per_s_ratio_checked_to_unchecked": {
        "median": round(statistics.median(ratios), 3), "min": round(min(ratios), 3),
        "max": round(max(ratios), 3), "rounds": len(ratios)}}))

if __name__ == "__main__":
    main()
