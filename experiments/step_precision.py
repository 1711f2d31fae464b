"""The untuned float32 training step (llvm, this machine's CPU) and PyTorch's float32 step, each
against PyTorch float64, by the step check's error formula, over many check batches.

    python experiments/step_precision.py --arch mobilenet_v2 --resolution 32 --width 0.35 \
        --batch 8 --seeds 20 [--trainable all] [--out bench/results/step_precision_mnv2.json]

Per seed (weights and batch drawn from it): the worst gradient error of each step, its
parameter, and each parameter's error, written to ``--out`` as JSON.
"""

import argparse
import json
import time

import numpy as np
import tvm
from tvm import relax

from thomas_tune import graph as G
from thomas_tune.compile import compile_graph
from thomas_tune.models import build, init_params
from thomas_tune.step_check import batch, compare_step, torch_step


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--arch", default="mobilenet_v2")
    ap.add_argument("--resolution", type=int, default=32)
    ap.add_argument("--width", type=float, default=0.35)
    ap.add_argument("--classes", type=int, default=10)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--trainable", default="all")
    ap.add_argument("--seeds", type=int, default=20)
    ap.add_argument("--out")
    a = ap.parse_args()
    model = build(a.arch, num_classes=a.classes, resolution=a.resolution, width=a.width)
    tg = G.training_module(model, a.batch, a.trainable)
    dev = tvm.cpu()
    vm = relax.VirtualMachine(compile_graph(tg.mod, tvm.target.Target({"kind": "llvm"})), dev)

    def t(v, dt="float32"):
        return tvm.runtime.tensor(np.ascontiguousarray(np.asarray(v, dt)), dev)

    rows = []
    for seed in range(a.seeds):
        t0 = time.time()
        tensors = init_params(model, seed)
        x, y = batch(model, a.batch, seed)
        masks = [t(np.ones(s)) for s, _ in tg.masks.values()]
        ret, grads = vm[G.ADJOINT](t(x), *masks,
                                   *[t(tensors[n]) for n in tg.frozen + tg.trainable + tg.states],
                                   t(y, "int64"))
        loss = float((ret[0] if tg.states else ret).numpy())
        g32 = {n: g.numpy().astype("float64") for n, g in zip(tg.trainable, grads)}
        l64, r64 = torch_step(model, tensors, tg.trainable, x, y, dtype="float64",
                              frozen_bn=tg.batchnorm == "frozen")
        l32, r32 = torch_step(model, tensors, tg.trainable, x, y, dtype="float32",
                              frozen_bn=tg.batchnorm == "frozen")
        ours, theirs = compare_step(loss, g32, l64, r64), compare_step(l32, r32, l64, r64)
        rows.append({"seed": seed, "tvm": ours.errors, "torch": theirs.errors,
                     "tvm_loss_err": ours.loss_err, "torch_loss_err": theirs.loss_err})
        print(f"seed {seed:2d}: untuned {ours.worst[1]:.1e} ({ours.worst[0]}), PyTorch float32 "
              f"{theirs.worst[1]:.1e} ({theirs.worst[0]}); loss {ours.loss_err:.1e} / "
              f"{theirs.loss_err:.1e} ({time.time() - t0:.1f} s)", flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"args": vars(a), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
