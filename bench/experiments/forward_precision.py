"""Layer by layer, how far the float32 forward pass is from float64: this tree's build for
``--target`` (default schedules, the inference graph; ``llvm`` by default, an OpenCL target on
this machine's first OpenCL device) beside PyTorch float32 (CPU), same weights and batch.

    python bench/experiments/forward_precision.py --arch alexnet --resolution 224 --classes 10 \
        --batch 32 --seeds 0,1,2 [--target targets/h100_opencl.json] [--out F.json]

For every convolution of the network, the error of its ReLU output (the max-pool input where one
follows) against PyTorch float64's, max |y - y64| / max |y64|: one number per layer and build,
the error accumulated by the forward pass up to there. Our kernels' outputs are read with the
Relax VM's instrument (each fused convolution + bias + ReLU kernel in call order); PyTorch's
with a recording ``TorchGraph``. Also counted, where a max-pool follows: its windows whose
largest input is another element in float32 than in float64 (``flips``).
"""

import argparse
import json

import numpy as np
import torch
import tvm
from tvm import relax

from thomas_tune.training_graph import graph as G
from thomas_tune.compiler.compile import compile_graph
from thomas_tune.models import build, init_params, spec
from thomas_tune.reference import TorchGraph
from thomas_tune.step_check import batch
from thomas_tune.target import parse_target


class RecordingGraph(TorchGraph):
    """TorchGraph that keeps every convolution's output (after its bias) and ReLU output."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.seen = []

    def conv2d(self, name, x, *args, **kw):
        y = super().conv2d(name, x, *args, **kw)
        self.seen.append((f"{name} conv", y.detach().numpy()))
        return y

    def relu(self, x):
        y = super().relu(x)
        self.seen.append(("relu", y.detach().numpy()))
        return y


def torch_forward(model, tensors, x, dtype):
    s = spec(model)
    p = {q.name: torch.tensor(np.asarray(tensors[q.name], dtype)) for q in s.params}
    g = RecordingGraph(p, {}, {}, False)
    with torch.no_grad():
        model.forward(g, torch.tensor(np.asarray(x, dtype)))
    out, conv = [], None
    for name, y in g.seen:  # (conv name, conv output, relu output) per convolution
        if name.endswith(" conv"):
            conv = (name[:-5], y)
        elif conv is not None:
            out.append((conv[0], conv[1], y))
            conv = None
    return out


def ours_forward(model, tensors, x, batch_size, target):
    mod = G.inference_module(model, batch_size, "float32")
    dev = tvm.cpu() if target.kind.name == "llvm" else tvm.opencl(0)
    vm = relax.VirtualMachine(compile_graph(mod, target), dev)
    outs = []

    def instrument(func, sym, before, ret, *args):
        if not before and "conv2d" in sym:
            outs.append((sym, args[-1].numpy()))
        return 0

    vm.set_instrument(instrument)
    s = spec(model)
    vm[G.PREDICT](tvm.runtime.tensor(x, dev),
                  *[tvm.runtime.tensor(np.asarray(tensors[q.name], "float32"), dev)
                    for q in s.params])
    return outs


def rel(a, b):
    return float(np.abs(a.astype("float64") - b).max() / np.abs(b).max())


def flips(y32, y64):
    """Windows (3x3, stride 2) of the max-pool whose argmax differs."""
    t32 = torch.nn.functional.max_pool2d(torch.tensor(y32), 3, 2, return_indices=True)[1]
    t64 = torch.nn.functional.max_pool2d(torch.tensor(y64), 3, 2, return_indices=True)[1]
    return int((t32 != t64).sum())


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--arch", default="alexnet")
    ap.add_argument("--resolution", type=int, default=224)
    ap.add_argument("--width", type=float, default=1.0)
    ap.add_argument("--classes", type=int, default=10)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--seeds", default="0")
    ap.add_argument("--target", default="llvm")
    ap.add_argument("--out")
    a = ap.parse_args()
    target = parse_target(a.target)
    torch.set_num_threads(2)
    model = build(a.arch, num_classes=a.classes, resolution=a.resolution, width=a.width)
    rows = []
    pools = {"features.0", "features.3", "features.10"}
    for seed in [int(s) for s in a.seeds.split(",")]:
        tensors = init_params(model, seed)
        x, _ = batch(model, a.batch, seed)
        ref = torch_forward(model, tensors, x, "float64")
        pt = torch_forward(model, tensors, x, "float32")
        ours = ours_forward(model, tensors, x, a.batch, target)
        assert len(ours) == len(ref), ([s for s, _ in ours], len(ref))
        for (name, c64, r64), (_, c32, r32), (sym, o32) in zip(ref, pt, ours):
            row = {"seed": seed, "layer": name, "kernel": sym,
                   "torch_conv": rel(c32, c64), "torch_relu": rel(r32, r64),
                   "ours_relu": rel(o32, r64)}
            if name in pools:
                row["torch_flips"], row["ours_flips"] = flips(r32, r64), flips(o32, r64)
            rows.append(row)
            print(f"seed {seed} {name:12s} relu err ours {row['ours_relu']:.2e} torch "
                  f"{row['torch_relu']:.2e} ratio {row['ours_relu'] / row['torch_relu']:.2f}"
                  + (f"  flips ours {row['ours_flips']} torch {row['torch_flips']}"
                     if name in pools else "") + f"  [{sym}]", flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
