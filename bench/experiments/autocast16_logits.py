"""How far ``--precision autocast16``'s logits are from float64, beside PyTorch's own autocast
float16: the inference graph built for llvm (the CPU computes float16 as LLVM's ``half``: no
device here has ``cl_khr_fp16``) at autocast16 and at float32, against PyTorch float64 and
PyTorch's autocast float16 on the CPU (``torch.autocast("cpu", dtype=torch.float16)`` on the
float32 module of ``thomas_tune.reference.torch_module``), same weights and batches.

    python bench/experiments/autocast16_logits.py --arch mobilenet_v2 --batches 4 [--seed 0]

The tests' small networks (``tests/conftest.py``'s SMALL), batch 4, standard-normal images;
MobileNetV2 with the demo's pretrained weights (as ``tests/test_adreno.py`` runs it), AlexNet
with random ones. Per batch: max |logits - float64's| / max |float64's| of the autocast16
build, of PyTorch's autocast float16 and of the float32 build, and the autocast16 build's
distance to PyTorch's autocast on the same scale (docs/journal/precision.md).
"""

import argparse
import os
import sys
import time

import numpy as np
import torch
import tvm
from tvm.relax import VirtualMachine

from thomas_tune.training_graph import graph as G
from thomas_tune.compiler.compile import compile_graph
from thomas_tune.half_arith import autocast_module
from thomas_tune.manifest import PREDICT
from thomas_tune.models import build, spec
from thomas_tune.reference import torch_module
from thomas_tune.target import parse_target

sys.path.insert(0, os.path.join(os.path.abspath(os.path.join(__file__, "../../..")),
                                "tests"))
from conftest import SMALL, random_tensors  # noqa: E402  (the tests' sizes and weights)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", choices=["alexnet", "mobilenet_v2"], default="mobilenet_v2")
    ap.add_argument("--batches", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    model = build(args.arch, **SMALL[args.arch])
    rng = np.random.default_rng(args.seed)
    tensors = random_tensors(model, rng)
    if args.arch == "mobilenet_v2":
        from thomas_tune.demo import pretrained_path
        from thomas_tune.models import load_checkpoint
        model, tensors, _ = load_checkpoint(pretrained_path())
    b = 4
    vms = {}
    for precision in ("autocast16", "float32"):
        mod = G.inference_module(model, b)
        if precision == "autocast16":
            mod = autocast_module(mod, {PREDICT: b})
        t0 = time.perf_counter()
        vms[precision] = VirtualMachine(compile_graph(mod, parse_target("llvm")), tvm.cpu())
        print(f"{precision}: compiled in {time.perf_counter() - t0:.1f} s", flush=True)
    s = spec(model)
    weights = [tvm.runtime.tensor(np.asarray(tensors[p.name], "float32"))
               for p in (*s.params, *s.states)]
    net64 = torch_module(model, tensors, "float64").eval()
    net32 = torch_module(model, tensors, "float32").eval()
    for i in range(args.batches):
        x = rng.standard_normal(model.input_shape(b)).astype("float32")
        with torch.no_grad():
            ref = net64(torch.tensor(x, dtype=torch.float64)).numpy()
            with torch.autocast("cpu", dtype=torch.float16):
                theirs = net32(torch.tensor(x)).float().numpy()
        ours = {k: vm["predict"](tvm.runtime.tensor(x), *weights).numpy()
                for k, vm in vms.items()}
        scale = float(np.abs(ref).max())

        def err(a, to=ref):
            return float(np.abs(a - to).max()) / scale
        print(f"batch {i}: autocast16 {err(ours['autocast16']):.2e}, PyTorch autocast float16 "
              f"{err(theirs):.2e}, float32 {err(ours['float32']):.2e}; autocast16 vs "
              f"PyTorch's {err(ours['autocast16'], theirs):.2e}", flush=True)


if __name__ == "__main__":
    main()
