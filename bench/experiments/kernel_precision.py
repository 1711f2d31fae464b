"""Kernel by kernel, where the untuned float32 training step leaves float64.

    python bench/experiments/kernel_precision.py --arch mobilenet_v2 --resolution 32 --width 0.35 \
        --batch 8 --seed 0 [--target targets/h100_opencl.json] [--dump CALL]

The float64 step is built for llvm; the float32 one for ``--target`` (llvm by default; an OpenCL
target runs on this machine's first OpenCL device), both with default schedules.

The float64 step runs first with every kernel call's arguments recorded (before and after).
The float32 step then runs the same kernels in the same order; before each call, the float32
kernel also runs alone on the float64 call's inputs rounded to float32 ("own": that kernel's
rounding, against the larger of its output's and its inputs' largest value), and after each call
its outputs are compared with the float64 step's ("acc": the error accumulated up to there,
against the output's largest value). ``--dump CALL`` saves both steps' arguments of that call
to /tmp/kernel_precision_<arg>_<32|64>.npy.
"""

import argparse

import numpy as np
import tvm
from tvm import relax

from thomas_tune.training_graph import graph as G
from thomas_tune.compiler.compile import compile_graph
from thomas_tune.models import build, init_params
from thomas_tune.step_check import batch
from thomas_tune.target import parse_target


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--arch", default="mobilenet_v2")
    ap.add_argument("--resolution", type=int, default=32)
    ap.add_argument("--width", type=float, default=0.35)
    ap.add_argument("--classes", type=int, default=10)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--trainable", default="all")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dump", type=int, default=-1)
    ap.add_argument("--target", default="llvm")
    a = ap.parse_args()
    target = parse_target(a.target)
    model = build(a.arch, num_classes=a.classes, resolution=a.resolution, width=a.width)
    tensors = init_params(model, a.seed)
    x, y = batch(model, a.batch, a.seed)
    record = []

    def floats(arr):
        return arr is not None and arr.dtype.kind == "f"

    def run(dt):
        tg = G.training_module(model, a.batch, a.trainable, dtype=dt)
        on = parse_target("llvm") if dt == "float64" else target
        dev = tvm.cpu() if on.kind.name == "llvm" else tvm.opencl(0)
        vm = relax.VirtualMachine(compile_graph(tg.mod, on), dev)
        calls = []

        def instrument(func, sym, before, ret, *args):
            if sym.startswith("vm.") or not args:
                return 0
            arrs = [v.numpy() if hasattr(v, "numpy") else None for v in args]
            if dt == "float64":
                if before:
                    calls.append([sym, arrs, None])
                else:
                    calls[-1][2] = arrs
                return 0
            i = len(calls) - (0 if before else 1)
            sym64, in64, out64 = record[i]
            assert sym64 == sym, (sym64, sym)
            outputs = [j for j, (b, o) in enumerate(zip(in64, out64))
                       if floats(b) and not np.array_equal(b, o)]
            if before:
                calls.append(sym)
                fresh = [tvm.runtime.tensor(np.array(b, dtype=v.dtype, order="C"), dev)
                         if floats(b) else v for v, b in zip(args, in64)]
                func(*fresh)
                scale_in = max([np.abs(b).max() for j, b in enumerate(in64)
                                if floats(b) and b.size and j not in outputs] + [1e-30])
                own = [np.abs(fresh[j].numpy() - out64[j]).max()
                       / max(np.abs(out64[j]).max(), scale_in) for j in outputs]
                print(f"own {i:4d} {sym:60.60s} " + " ".join(f"{e:.1e}" for e in own))
            else:
                acc = [np.abs(args[j].numpy() - out64[j]).max()
                       / max(np.abs(out64[j]).max(), 1e-30) for j in outputs]
                print(f"acc {i:4d} {sym:60.60s} " + " ".join(f"{e:.1e}" for e in acc))
                if i == a.dump:
                    for j in range(len(args)):
                        if floats(out64[j]):
                            np.save(f"/tmp/kernel_precision_{j}_32.npy", args[j].numpy())
                            np.save(f"/tmp/kernel_precision_{j}_64.npy", out64[j])
            return 0

        vm.set_instrument(instrument)

        def t(v, d=dt):
            return tvm.runtime.tensor(np.ascontiguousarray(np.asarray(v, d)), dev)

        masks = [t(np.ones(s)) for s, _ in tg.masks.values()]
        vm[G.ADJOINT](t(x), *masks, *[t(tensors[n]) for n in tg.frozen + tg.trainable + tg.states],
                      t(y, "int64"))
        return calls

    record.extend(run("float64"))
    run("float32")


if __name__ == "__main__":
    main()
