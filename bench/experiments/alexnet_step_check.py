"""The step check of AlexNet exported from fresh weights (default schedules), one line per seed,
with every parameter's error beside its bound and PyTorch float32's.

    python bench/experiments/alexnet_step_check.py --target llvm --batch 32 --seeds 0,1,2 \
        [--resolution 224 --classes 10] [--reference-dir /tmp/ref] [--out F.json]

Per seed: the weights of ``models.init_params(model, seed)``, every layer trainable, no tuning
log, checked as :func:`thomas_tune.export_check.check_export` checks an export on that seed's
batches. On ``llvm`` the training module is compiled and run here without an export (the llvm
export of AlexNet@224 at batch 32 ran out of this 23 GB machine's memory); other targets are
exported and checked with ``check_export``. ``--reference-dir`` keeps PyTorch's float64 and
float32 steps per seed (pickled), so that two trees' builds are checked against the same
reference without running it again.
"""

import argparse
import json
import os
import pickle
import tempfile

import numpy as np
import tvm
from tvm import relax

from thomas_tune.training_graph import graph as G
from thomas_tune.compiler.compile import compile_graph
from thomas_tune.compiler.export import export
from thomas_tune.training_graph.graph import select_trainable
from thomas_tune.models import build, init_params
from thomas_tune.export_check import check_export
from thomas_tune.step_check import compare_step, reference_steps
from thomas_tune.target import parse_target


def llvm_step(vm, tg, tensors, x, y):
    """Loss and gradients (name -> float64) of the compiled training module's step, dropout
    masks of ones (as :func:`thomas_tune.step_check.export_step`)."""
    def t(v, dt="float32"):
        return tvm.runtime.tensor(np.ascontiguousarray(np.asarray(v, dt)), tvm.cpu())

    masks = [t(np.ones(s)) for s, _ in tg.masks.values()]
    ret, grads = vm[G.ADJOINT](t(x), *masks,
                               *[t(tensors[n]) for n in tg.frozen + tg.trainable + tg.states],
                               t(y, "int64"))
    return (float((ret[0] if tg.states else ret).numpy()),
            {n: g.numpy().astype("float64") for n, g in zip(tg.trainable, grads)})


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="llvm")
    ap.add_argument("--resolution", type=int, default=224)
    ap.add_argument("--classes", type=int, default=10)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--reference-dir")
    ap.add_argument("--out")
    a = ap.parse_args()
    target = parse_target(a.target)
    rows, vm, tg = [], None, None
    for seed in (int(s) for s in a.seeds.split(",")):
        model = build("alexnet", num_classes=a.classes, resolution=a.resolution)
        tensors = init_params(model, seed)
        ref, path = None, None
        if a.reference_dir:
            os.makedirs(a.reference_dir, exist_ok=True)
            path = os.path.join(a.reference_dir, f"alexnet_{a.resolution}_{a.classes}_"
                                f"{a.batch}_{seed}.pkl")
            if os.path.exists(path):
                with open(path, "rb") as f:
                    ref = pickle.load(f)
        if ref is None:
            ref = reference_steps(model, tensors, select_trainable(model, "all"), a.batch, seed)
            if path is not None:
                with open(path, "wb") as f:
                    pickle.dump(ref, f)
        if target.kind.name == "llvm":
            if vm is None:
                tg = G.training_module(model, a.batch, "all")
                vm = relax.VirtualMachine(compile_graph(tg.mod, target), tvm.cpu())
            ours = [llvm_step(vm, tg, tensors, x, y) for x, y in ref["batches"]]
            yard = ref["yardstick"]
            check = compare_step([o[0] for o in ours], [o[1] for o in ours],
                                 [r[0] for r in ref["float64"]], [r[1] for r in ref["float64"]],
                                 yard.errors, yard.loss_err)
        else:
            with tempfile.TemporaryDirectory() as out:
                export(out, model, tensors, target, batch=a.batch, infer_batch=1,
                       trainable="all", progress=lambda *_: None)
                check = check_export(out, seed=seed, reference=ref)
        print(seed, check.line(), flush=True)
        for name, err in check.errors.items():
            print(f"   {name:24s} {err:.2e} bound {check.bounds[name]:.2e} "
                  f"PyTorch float32 {check.yardstick.get(name, float('nan')):.2e}")
        rows.append({"seed": seed, **check.as_dict()})
    if a.out:
        with open(a.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
