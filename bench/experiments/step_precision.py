"""The untuned float32 training step (llvm, this machine's CPU) and PyTorch's float32 step, each
against PyTorch float64, by the step check's error formula, over many check batches.

    python bench/experiments/step_precision.py --arch mobilenet_v2 --resolution 32 --width 0.35 \
        --batch 8 --seeds 20 [--trainable all] [--out bench/results/step_precision_mnv2.json]

Per seed (weights and batch drawn from it): the worst gradient error of each step, its
parameter, and each parameter's error, written to ``--out`` as JSON. ``--summary FILE`` reads
such a file and prints what the step check's bounds rest on: how many seeds have a flipped
kink (worst error above 1e-2) in each step, and, over groups of three consecutive seeds (the
check's three batches: per parameter the smallest error of the group), the largest ratio of the
untuned build's error to max(PyTorch float32's, 1e-4), and of the loss errors to max(PyTorch's,
2e-6).
"""

import argparse
import json
import time

import numpy as np
import tvm
from tvm import relax

from thomas_tune.training_graph import graph as G
from thomas_tune.compiler.compile import compile_graph
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
    ap.add_argument("--summary", help="print the summary of a result file and stop")
    a = ap.parse_args()
    if a.summary:
        return summary(a.summary)
    model = build(a.arch, num_classes=a.classes, resolution=a.resolution, width=a.width)
    tg = G.training_module(model, a.batch, a.trainable)
    dev = tvm.cpu()
    vm = relax.VirtualMachine(compile_graph(tg.mod, tvm.target.Target({"kind": "llvm"})), dev)

    def t(v, dt="float32"):
        return tvm.runtime.tensor(np.ascontiguousarray(np.asarray(v, dt)), dev)

    rows = {"untuned": [], "torch_float32": [], "untuned_loss_err": [],
            "torch_float32_loss_err": [], "seeds": []}
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
        for k, v in (("untuned", [ours.errors[n] for n in tg.trainable]),
                     ("torch_float32", [theirs.errors[n] for n in tg.trainable]),
                     ("untuned_loss_err", ours.loss_err),
                     ("torch_float32_loss_err", theirs.loss_err), ("seeds", seed)):
            rows[k].append(v)
        print(f"seed {seed:2d}: untuned {ours.worst[1]:.1e} ({ours.worst[0]}), PyTorch float32 "
              f"{theirs.worst[1]:.1e} ({theirs.worst[0]}); loss {ours.loss_err:.1e} / "
              f"{theirs.loss_err:.1e} ({time.time() - t0:.1f} s)", flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"args": vars(a), "parameters": tg.trainable, **rows}, f,
                      separators=(",", ":"))


def summary(path: str, group: int = 3, floor: float = 1e-4, loss_floor: float = 2e-6):
    with open(path) as f:
        d = json.load(f)
    ours, theirs = np.array(d["untuned"]), np.array(d["torch_float32"])
    lo, lt = np.array(d["untuned_loss_err"]), np.array(d["torch_float32_loss_err"])
    print(f"{len(ours)} seeds; worst error above 1e-2 (a flipped kink): untuned "
          f"{int((ours.max(1) > 1e-2).sum())}, PyTorch float32 {int((theirs.max(1) > 1e-2).sum())}")
    calm = (ours.max(1) < 1e-2) & (theirs.max(1) < 1e-2)
    print(f"seeds with neither: median worst untuned {np.median(ours.max(1)[calm]):.1e}, "
          f"PyTorch float32 {np.median(theirs.max(1)[calm]):.1e}")
    n = len(ours) // group
    g_ours = np.array([ours[i * group:(i + 1) * group].min(0) for i in range(n)])
    g_theirs = np.array([theirs[i * group:(i + 1) * group].min(0) for i in range(n)])
    ratio = (g_ours / np.maximum(g_theirs, floor)).max(1)
    g_lo = np.array([lo[i * group:(i + 1) * group].max() for i in range(n)])
    g_lt = np.array([lt[i * group:(i + 1) * group].max() for i in range(n)])
    loss_ratio = g_lo / np.maximum(g_lt, loss_floor)
    print(f"{n} groups of {group}: largest gradient ratio per group (sorted) "
          f"{np.round(np.sort(ratio), 2).tolist()}; loss ratio largest {loss_ratio.max():.2f}, "
          f"median {np.median(loss_ratio):.2f}")


if __name__ == "__main__":
    main()
