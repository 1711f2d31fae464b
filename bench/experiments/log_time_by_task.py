"""A step's kernel time as a tuning log states it, task by task, for each precision.

For each task of a model's training step (the training module's functions but its own
``predict``) and inference graph (``thomas-tune tasks`` with the same options), its calls per
run, its default-schedule time measured on the device (``default_latency.json`` in the log
folder), the mean time of its best record in the log, and the smaller of the two times its
calls: what an export of that log would spend in the task, as the device measured each kernel
alone. Both forms of a convolution that the Winograd form takes are counted (an export runs
one). The sum over the tasks is the graph's kernel time so estimated (tasks with neither time
count nothing). Prints the sums and the 25 costliest tasks.

    python bench/experiments/log_time_by_task.py LOG float32 mixed16 -- --model alexnet \\
        --width 1 --resolution 224 --classes 1000 --batch 32 --trainable all \\
        --target targets/h100_opencl.json
"""

from __future__ import annotations

import math
import sys

import tvm

from thomas_tune.cli.main import parser
from thomas_tune.cli.options import load_model, model_graphs
from thomas_tune.logs import TuningLog
from thomas_tune.target import parse_target
from thomas_tune.tasks import extract, key
from thomas_tune.tuning.defaults import read_default_times

split = sys.argv.index("--")
log_path, precisions, options = sys.argv[1], sys.argv[2:split], sys.argv[split + 1:]
log = TuningLog(log_path)
database = log.database()

for precision in precisions or ["float32"]:
    args = parser().parse_args(["tasks", *options, "--precision", precision])
    model, _, _ = load_model(args)
    target = parse_target(args.target, args.host)
    graphs = model_graphs(args, model)
    # one training step runs the training module's forward-and-backward and optimizer
    # functions, not its own ``predict`` (a forward pass of its own)
    train = graphs["train"]
    graphs["train"] = tvm.IRModule({gv: f for gv, f in train.functions.items()
                                    if gv.name_hint != "predict"}, attrs=train.attrs)
    for graph in ("train", "infer"):
        tasks = extract({graph: graphs[graph]}, target)
        defaults = read_default_times(log_path, target, {key(t): t.mod for t in tasks}) or {}
        rows = []
        for t in tasks:
            default = defaults.get(key(t), math.nan)
            best = log.best_seconds(database, t.mod) or math.nan
            used = min((s for s in (default, best) if math.isfinite(s)), default=math.nan)
            rows.append((used * t.weight, t.weight, default, best, t.name))
        rows.sort(key=lambda r: -r[0] if math.isfinite(r[0]) else 0.0)
        total = sum(r[0] for r in rows if math.isfinite(r[0]))
        untimed = sum(1 for r in rows if not math.isfinite(r[0]))
        print(f"== {precision} {graph}: {len(tasks)} tasks, {total * 1e3:.2f} ms "
              f"({untimed} with no time)")
        for used, calls, default, best, name in rows[:25]:
            print(f"{used * 1e3:8.3f} ms  x{calls}  default {default * 1e3:8.3f}  "
                  f"best {best * 1e3:8.3f}  {name[:90]}")
