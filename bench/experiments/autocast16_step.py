"""How far ``--precision autocast16``'s training step is from float64, beside PyTorch's own
autocast float16 step: the tests' small network exported for llvm (float16 computed by LLVM: no
device here has ``cl_khr_fp16``) at autocast16 and at float32, every layer trainable, batch 8,
against PyTorch's float64 step and its autocast float16 step on the CPU
(``torch.autocast("cpu", dtype=torch.float16)`` around ``kink_step.torch_forward`` in float32),
on ``step_check.batch``'s batches of seeds 0, 1, 2, dropout off.

    python bench/experiments/autocast16_step.py --arch alexnet

Per batch: the loss of each, and per build the median and largest over the parameters of
``step_check.gradient_errors`` against float64 (max |g - g64| / max |g64|; no floor for
biases whose gradient cancels, so a BatchNorm-preceded bias's largest error is not meaningful)
(docs/journal/precision.md).
"""

import argparse
import os
import sys
import tempfile

import numpy as np
import torch

from thomas_tune.compiler.export import export
from thomas_tune.kink_step import torch_forward
from thomas_tune.models import build
from thomas_tune.step_check import batch, export_step, gradient_errors
from thomas_tune.target import parse_target

sys.path.insert(0, os.path.join(os.path.abspath(os.path.join(__file__, "../../..")),
                                "tests"))
from conftest import SMALL, random_tensors  # noqa: E402  (the tests' sizes and weights)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", choices=["alexnet", "mobilenet_v2"], default="alexnet")
    args = ap.parse_args()
    model = build(args.arch, **SMALL[args.arch])
    tensors = random_tensors(model, np.random.default_rng(0))
    if args.arch == "mobilenet_v2":
        from thomas_tune.demo import pretrained_path
        from thomas_tune.models import load_checkpoint
        model, tensors, _ = load_checkpoint(pretrained_path())
    b = 8
    with tempfile.TemporaryDirectory() as tmp:
        outs = {}
        for precision in ("autocast16", "float32"):
            outs[precision] = os.path.join(tmp, precision)
            manifest = export(outs[precision], model, tensors, parse_target("llvm"), batch=b,
                              precision=precision, progress=lambda *_: None)
        for seed in range(3):
            x, y = batch(model, b, seed)

            def torch_step(dtype):
                loss, _, params, names = torch_forward(model, tensors, manifest.trainable,
                                                       x, y, dtype=dtype)
                grads = torch.autograd.grad(loss, params)
                return float(loss.detach()), {n: g.detach().double().numpy()
                                              for n, g in zip(names, grads)}
            loss64, g64 = torch_step("float64")
            with torch.autocast("cpu", dtype=torch.float16):
                steps = {"PyTorch autocast float16": torch_step("float32")}
            for precision, out in outs.items():
                steps[f"{precision} (llvm)"] = export_step(out, x, y)
            parts = []
            for what, (loss, g) in steps.items():
                e = np.array(list(gradient_errors(g, g64).values()))
                parts.append(f"{what}: loss {loss:.5f}, gradients median {np.median(e):.2e} "
                             f"largest {e.max():.2e}")
            print(f"batch {seed}: float64 loss {loss64:.5f}; " + "; ".join(parts), flush=True)


if __name__ == "__main__":
    main()
