"""Kernel by kernel, side by side in one process: the default GPU schedule of today's rules
(``thomas_tune.schedules.GPU_RULES``) against the one the kernels had when shared memory was
counted at declared buffer shapes (``LongReduction``, else dlight's thread-per-output
``Fallback``), on this machine's OpenCL device, same random inputs for both.

    python bench/experiments/default_rules.py --model alexnet --resolution 224 --batch 32 \
        --classes 1000 \
        --match matmul --count 4
    python bench/experiments/default_rules.py --model mobilenet_v2 --width 0.35 --resolution 64 \
        --batch 8 --classes 10 --count 12

Prints per kernel: calls per step, the new rule, both times (ms, mean of 3x3 runs) and the
largest difference of the outputs relative to the largest output.
"""

from __future__ import annotations

import argparse

import numpy as np
import tvm
from tvm.s_tir import dlight as dl
from tvm.s_tir.meta_schedule.arg_info import ArgInfo

from thomas_tune.training_graph import graph as G
from thomas_tune import schedules as S
from thomas_tune.models import build
from thomas_tune.target import parse_target
from thomas_tune.tasks import extract


def first_schedule(func, rules, target):
    """(rule name, scheduled PrimFunc) of the first rule that schedules ``func``."""
    limit = int(target.attrs.get("max_shared_memory_per_block", 16384))
    for rule in rules:
        try:
            with target:
                sch = rule.apply(func, target, False)
        except Exception:  # a rule that cannot take this kernel
            sch = None
        if isinstance(sch, list):
            sch = sch[0] if sch else None
        if sch is not None and S.shared_bytes(sch.mod["main"], target) <= limit:
            return type(rule).__name__, sch.mod["main"].with_attr("tir.is_scheduled", True)
    return None


def time_kernel(func, target, seed: int) -> tuple[float, np.ndarray]:
    """(ms per call, output) of ``func`` on OpenCL device 0, inputs drawn from ``seed``."""
    rng = np.random.default_rng(seed)
    dev = tvm.opencl(0)
    exe = tvm.compile(tvm.IRModule({"main": func}), target=target)
    lib = exe.mod if hasattr(exe, "mod") else exe
    args = []
    for info in ArgInfo.from_prim_func(func):
        shape, dtype = [int(d) for d in info.shape], str(info.dtype)
        a = (rng.standard_normal(shape) if dtype.startswith("float")
             else rng.integers(0, 2, shape)).astype(dtype)
        args.append(tvm.runtime.tensor(a, dev))
    lib["main"](*args)
    out = args[-1].numpy()
    return lib.time_evaluator("main", dev, number=3, repeat=3)(*args).mean * 1e3, out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="mobilenet_v2")
    p.add_argument("--width", type=float, default=1.0)
    p.add_argument("--resolution", type=int, default=224)
    p.add_argument("--classes", type=int, default=1000)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--match", default="", help="only kernels whose name contains this")
    p.add_argument("--count", type=int, default=8, help="kernels to time (largest first)")
    args = p.parse_args()
    model = build(args.model, num_classes=args.classes, resolution=args.resolution,
                  width=args.width)
    target = parse_target("opencl")
    tasks = extract({"train": G.training_module(model, args.batch, "all").mod}, target)
    new_rules = [r() for r in S.GPU_RULES]
    old_rules = [S.LongReduction(), dl.gpu.Fallback()]
    done = 0
    seeds = np.random.SeedSequence()
    for task in sorted(tasks, key=lambda t: -t.total_flops):
        func = task.mod["main"]
        if args.match not in task.name or S.tuple_reduction(func):
            continue
        new, old = first_schedule(func, new_rules, target), first_schedule(func, old_rules,
                                                                            target)
        if new is None or old is None or new[0] == old[0]:
            continue
        seed = int(seeds.spawn(1)[0].generate_state(1)[0])
        t_old, o_old = time_kernel(old[1], target, seed)
        t_new, o_new = time_kernel(new[1], target, seed)
        diff = np.abs(o_old - o_new).max() / max(np.abs(o_old).max(), 1e-30)
        print(f"{task.name[:44]:44} x{task.weight:<2} {new[0]:>20}: {old[0]} {t_old:9.3f} ms "
              f"-> {t_new:9.3f} ms ({t_old / t_new:5.2f}x)  rel. diff {diff:.1e}", flush=True)
        done += 1
        if done >= args.count:
            break


if __name__ == "__main__":
    main()
