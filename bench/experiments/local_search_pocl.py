"""Local search and the trained cost model side by side on PoCL: one task tuned from nothing with
each setting, settings interleaved per seed in one process, over a loopback tracker and one
device server.

Settings: ``evolutionary`` (``local_share=0``, untrained model), ``local`` (``local_share=0.25``,
untrained), ``local+model`` (``local_share=0.25``, the model of ``--cost-model``). Per seed the
reference is the best time any setting found; per run it prints the best time and the trials
to within 5% of that reference (None: not reached). Example (docs/journal/cost-model.md):

    python bench/experiments/local_search_pocl.py --trials 64 --seeds 0,1 \\
        --cost-model tuning_logs/h100/cost_model
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time


def main(argv=None) -> int:
    from thomas_tune.training_graph import graph as G
    from thomas_tune import opencl, rpc
    from thomas_tune.logs import TuningLog
    from thomas_tune.models import build
    from thomas_tune.tasks import extract
    from thomas_tune.tuning import rpc_runner, tune
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trials", type=int, default=64)
    ap.add_argument("--seeds", default="0,1")
    ap.add_argument("--task", type=int, default=-1, help="index among the tasks by FLOPs")
    ap.add_argument("--cost-model", default="tuning_logs/h100/cost_model")
    args = ap.parse_args(argv)
    target = opencl.target_for(0)
    model = build("mobilenet_v2", num_classes=5, resolution=32, width=0.35)
    tasks = sorted((t for t in extract({"infer": G.inference_module(model, 1)}, target)
                    if t.flops > 0), key=lambda t: t.flops)
    task = tasks[args.task]
    settings = {"evolutionary": dict(local_share=0.0), "local": dict(local_share=0.25),
                "local+model": dict(local_share=0.25, cost_model=args.cost_model)}
    out = {"task": task.name, "trials": args.trials, "runs": []}
    with rpc.loopback(key="pocl", servers=1, lifetime=7200) as addr:
        for seed in [int(s) for s in args.seeds.split(",")]:
            runs = {}
            for name, extra in settings.items():
                with tempfile.TemporaryDirectory() as tmp:
                    log = TuningLog(tmp)
                    t0 = time.perf_counter()
                    tune([task], target, log, rpc_runner(addr, "pocl"), trials=args.trials,
                         trials_per_iter=8, population=32, show_progress=False, refine_top=0,
                         seed=seed, **extra)
                    times = log.database(check=False).times_in_order(task.mod)
                    runs[name] = (times, time.perf_counter() - t0)
            ref = min(min(t) for t, _ in runs.values())
            for name, (times, wall) in runs.items():
                reach = next((i for i in range(1, len(times) + 1)
                              if min(times[:i]) <= ref / 0.95), None)
                row = {"seed": seed, "setting": name, "best_us": min(times) * 1e6,
                       "trials_to_95pct_of_best_of_all": reach, "wall_s": round(wall, 1),
                       "failed": sum(1 for t in times if not math.isfinite(t))}
                print(json.dumps(row), file=sys.stderr, flush=True)
                out["runs"].append(row)
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
