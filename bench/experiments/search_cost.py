"""What one round of the tuner's evolutionary search costs on this host, and where it goes.

A tuning run alternates, per task, between a search round on the host (MetaSchedule's
evolutionary search: an initial population from the log's best records and random samples,
rounds of mutation, each member scored by the XGBoost cost model, the best not yet measured
picked) and the builds and measurements of the candidates it picked. On the H100 the search
became the bound once compiles were cheap (the history of docs/journal/h100.md, 2026-11-24 and 25).
This script times search rounds with no device: it builds one task of a model for a target,
resumes the task's records from a tuning log as ``thomas-tune tune`` does (``search_context``, with
``--max-unroll`` the log read through :class:`UnrollLimitedView`), trains the cost model on up
to ``--train`` of those records (a run's model learns from its own trials; this stands for one
well into a run), and runs ``--rounds`` rounds under MetaSchedule's profiler.

Per round it prints the wall seconds, the new candidates, the profiler's split (seconds:
``Evolve/Mutation``, ``Evolve/PredictNormalizedScore``, ``SampleInitPopulation``,
``PickBestFromDatabase``) and the strategy's counts (``skipped``: already measured;
``clamped``: lowered to ``--max-unroll`` one at a time). Example (docs/journal/h100.md,
tuning speed):

    python bench/experiments/search_cost.py --model alexnet --width 1.0 --resolution 224 \\
        --classes 1000 \\
        --batch 32 --target targets/h100_opencl.json \\
        --log tuning_logs/h100/alexnet-w1-r224-c1000-b32 \\
        --max-unroll 64 --population 64 --genetic-iters 1 --trials-per-iter 48
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time


def main(argv=None) -> int:
    from thomas_tune.cli import options
    from thomas_tune.target import parse_target
    from thomas_tune.tasks import extract
    from thomas_tune.tuning import read_default_times, search_context
    from thomas_tune.tasks import key as workload_key
    from thomas_tune.logs import TuningLog
    from tvm.s_tir import meta_schedule as ms
    from tvm.s_tir.schedule import Schedule

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    options.add_model_args(p)
    options.add_target_arg(p)
    p.add_argument("--log", required=True, help="tuning log whose records the task resumes")
    p.add_argument("--task", type=int, default=0,
                   help="which task: its rank by default-schedule time x calls in the log's "
                        "default_latency.json (default 0, the slowest)")
    p.add_argument("--population", type=int, default=128)
    p.add_argument("--genetic-iters", type=int, default=2)
    p.add_argument("--trials-per-iter", type=int, default=48)
    p.add_argument("--max-unroll", type=int)
    p.add_argument("--train", type=int, default=400,
                   help="records the cost model is trained on first (default 400)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json", help="write the rounds here")
    args = p.parse_args(argv)

    model, _, _ = options.load_model(args)
    target = parse_target(args.target, args.host)
    tasks = extract(options.model_graphs(args, model), target)
    log = TuningLog(args.log)
    database = log.database()
    latency = read_default_times(log.path, target, {workload_key(t): t.mod for t in tasks})
    ranked = sorted(tasks, key=lambda t: -(latency.get(workload_key(t)) or 0.0) * t.weight)
    if not 0 <= args.task < len(ranked):
        raise SystemExit(f"--task {args.task}: the model has {len(ranked)} tasks (0 to "
                         f"{len(ranked) - 1})")
    task = ranked[args.task]
    t0 = time.perf_counter()
    measured = log.measured(database, task.mod)
    print(f"task {task.name}: {len(measured)} measured schedules in the log (replayed in "
          f"{time.perf_counter() - t0:.1f} s)", flush=True)

    ctx, strategy = search_context(task, target, measured, args.population,
                                   args.genetic_iters, args.max_unroll, seed=1)
    spaces = ctx.generate_design_space()
    cost_model = ms.cost_model.XGBModel(num_tuning_cores=os.cpu_count() or 1)
    records = (database.get_top_k(database.commit_workload(task.mod), args.train)
               if database.has_workload(task.mod) else [])
    cands, results = [], []
    for rec in records:
        sch = Schedule(task.mod)
        rec.trace.apply_to_schedule(sch, remove_postproc=False)
        cands.append(ms.MeasureCandidate(sch, rec.args_info))
        results.append(ms.runner.RunnerResult(rec.run_secs, None))
    if cands:
        t0 = time.perf_counter()
        cost_model.update(ctx, cands, results)
        print(f"cost model trained on {len(cands)} records in {time.perf_counter() - t0:.1f} s",
              flush=True)
    strategy.pre_tuning(1 << 20, args.trials_per_iter, spaces, database, cost_model)
    rounds = []
    for r in range(args.rounds):
        with ms.Profiler() as prof:
            t0 = time.perf_counter()
            got = strategy.generate_measure_candidates()
            wall = time.perf_counter() - t0
        split = {k.replace("EvoSearch/", ""): round(float(getattr(v, "value", v)), 3)
                 for k, v in prof.get().items() if k != "Total"}
        row = {"round": r, "seconds": round(wall, 3), "candidates": len(got or []),
               "split_s": split, **strategy.counts}
        rounds.append(row)
        print(json.dumps(row), flush=True)
    strategy.post_tuning()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"task": task.name, "cores": os.cpu_count(), "args": vars(args),
                       "rounds": rounds}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
