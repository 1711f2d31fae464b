"""What two-level sums (``schedules/accumulate.py``) cost a training step's kernels on this
machine's OpenCL device: each kernel built with TVM's default TIR pipeline and with the
product's, timed alone one after the other, summed over the step.

    python bench/experiments/two_level_cost.py --model alexnet --width 1.0 --resolution 224 \
        --classes 1000 --batch 32 --trainable all --target targets/h100_opencl.json \
        [--log tuning_logs/h100/alexnet-w1-r224-c1000-b32] [--max-accumulators 64,128] \
        [--out F.json]

Each kernel of the step (``benchmark.kernels.step_kernels``) gets its best record of
``--log`` (as the tuned build applies it) or its default schedule; it is built with the
``"default"`` pipeline and, for each ``--max-accumulators`` value, with the two-level one.
Only kernels whose OpenCL source the rewrite changed are timed: on fresh random inputs, the
two builds alternately, each the best of 3 repeats of at least 2 ms, three rounds, the median
per build. Prints per value the kernels changed, their summed ms per step both ways and the
ratio, and the largest slowdowns.
"""

import argparse
import json
import statistics

import numpy as np
import tvm

from thomas_tune.benchmark.kernels import exported_training_module, random_args, step_kernels
from thomas_tune.benchmark.peaks import seconds_per_call
from thomas_tune.cli.options import add_model_args, load_model, optimizer_config
from thomas_tune.training_graph import graph as G
from thomas_tune.compiler.compile import tuned_database
from thomas_tune.kernel_check import default_kernel
from thomas_tune.logs import TuningLog
from thomas_tune.schedules import accumulate
from thomas_tune.target import codegen_target, parse_target


def build(mod, target, pipeline):
    lib = tvm.compile(mod, codegen_target(target), tir_pipeline=pipeline)
    return lib, lib.mod.imports[0].inspect_source()


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_args(ap)
    ap.add_argument("--target", required=True)
    ap.add_argument("--log")
    ap.add_argument("--max-accumulators", default=str(accumulate.MAX_ACCUMULATORS))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out")
    args = ap.parse_args()
    target = parse_target(args.target)
    model, _, _ = load_model(args)
    tg = G.training_module(model, args.batch, args.trainable, optimizer_config(args))
    kernels = step_kernels(exported_training_module(tg))
    db = tuned_database(TuningLog(args.log), target)[0] if args.log else None
    dev = tvm.opencl(0)
    rng = np.random.default_rng(0)
    limits = [int(v) for v in args.max_accumulators.split(",")]
    result = {"model": vars(args), "limits": {}}
    for limit in limits:
        accumulate.MAX_ACCUMULATORS = limit
        rows = []
        for k in kernels:
            sch = db.query_schedule(k.mod, target, workload_name="main") if db else None
            mod = sch.mod if sch is not None else default_kernel(k.mod, target)
            try:
                plain, src0 = build(mod, target, "default")
                split, src1 = build(mod, target, accumulate.PIPELINE)
            except Exception as err:  # noqa: BLE001
                print(f"{k.name}: not built ({str(err).splitlines()[-1][:120]})")
                continue
            if src0 == src1:
                continue
            inputs = random_args(k.args, dev, rng)
            times = {"plain": [], "split": []}
            for _ in range(args.rounds):
                for label, lib in (("plain", plain), ("split", split)):
                    times[label].append(seconds_per_call(lib.mod, "main", dev, inputs, 2.0))
            p, s = (statistics.median(times[x]) * 1e3 for x in ("plain", "split"))
            rows.append({"kernel": k.name, "calls": k.calls, "tuned": sch is not None,
                         "plain_ms": p, "split_ms": s})
            print(f"  [{limit}] {k.name:44s} {k.calls} x {p:.4f} -> {s:.4f} ms "
                  f"({s / p:.2f}x){' tuned' if sch is not None else ''}", flush=True)
        plain = sum(r["calls"] * r["plain_ms"] for r in rows)
        split = sum(r["calls"] * r["split_ms"] for r in rows)
        result["limits"][limit] = {"rows": rows, "plain_ms": plain, "split_ms": split}
        print(f"max accumulators {limit}: {len(rows)} kernels changed, {plain:.3f} -> "
              f"{split:.3f} ms per step ({split / plain if plain else float('nan'):.3f}x)")
        for r in sorted(rows, key=lambda r: -r["calls"] * (r["split_ms"] - r["plain_ms"]))[:8]:
            print(f"    {r['kernel']:44s} +{r['calls'] * (r['split_ms'] - r['plain_ms']):.3f} ms")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
