"""The phone's target executed on this machine's OpenCL device: MobileNetV2 and AlexNet built for
``qcom/adreno-opencl`` and for the Adreno 540 limits (``targets/adreno540_opencl.json``) with
default schedules, each build's training step checked against PyTorch in float64 (loss and
every gradient, :mod:`thomas_tune.step_check`) and its inference logits likewise; one JSON line
per build (also appended to ``--out``).

    python3 bench/adreno_builds.py                       # the 224-px builds (the GPU machine)
    python3 bench/adreno_builds.py --small               # the sizes of tests/test_adreno.py

On the GPU machine (docs/gpu-machine.md), after ``park`` and ``setup``:
``bash tools/gpu_tune.sh py bench/adreno_builds.py --out $OUT/adreno_builds.jsonl``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TARGETS = ("qcom/adreno-opencl", os.path.join(ROOT, "targets", "adreno540_opencl.json"))
FULL = {"mobilenet_v2": dict(num_classes=10, resolution=224, width=1.0),
        "alexnet": dict(num_classes=10, resolution=224, width=1.0)}
SMALL = {"mobilenet_v2": dict(num_classes=5, resolution=64, width=0.35),
         "alexnet": dict(num_classes=5, resolution=67, width=0.1)}


def check_build(name: str, size: dict, target_text: str, batch: int, seed: int) -> dict:
    """Export ``name`` at ``size`` for ``target_text`` (default schedules) into a temporary
    folder, check its step and its inference against float64; returns the result row."""
    import torch
    import tvm

    from thomas_tune.compiler.export import export
    from thomas_tune.models import build, init_params
    from thomas_tune.reference import torch_module
    from thomas_tune.runtime import Session
    from thomas_tune.export_check import check_export
    from thomas_tune.target import parse_target
    target = parse_target(target_text)
    model = build(name, **size)
    tensors = init_params(model, seed=seed)
    row = {"model": name, **size, "target": os.path.basename(target_text), "batch": batch,
           "device": tvm.opencl(0).device_name}
    with tempfile.TemporaryDirectory(prefix="adreno-build-") as out:
        t0 = time.perf_counter()
        export(out, model, tensors, target, batch=batch, infer_batch=2, trainable="all",
               progress=lambda *_: None)
        row["export_s"] = round(time.perf_counter() - t0, 1)
        t0 = time.perf_counter()
        step = check_export(out, seed=seed)
        row.update(check_s=round(time.perf_counter() - t0, 1), step=step.line(),
                   step_ok=step.ok, loss=step.loss, loss_ref=step.loss_ref)
        x = np.random.default_rng(seed).standard_normal(model.input_shape(2)).astype("float32")
        got = Session(out).predict(x)
        with torch.no_grad():
            ref = torch_module(model, tensors, "float64")(torch.tensor(x, dtype=torch.float64))
        ref = ref.numpy()
        row["inference_rel_err"] = float(np.abs(got - ref).max() / np.abs(ref).max())
    return row


def main(argv=None) -> int:
    """Check every (model, target) build; returns 1 when any is wrong, else 0."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--small", action="store_true", help="the test sizes, not 224 px")
    p.add_argument("--batch", type=int, default=8, help="images per training step (default 8)")
    p.add_argument("--models", default="mobilenet_v2,alexnet")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", help="append the JSON lines to this file")
    p.add_argument("--targets", nargs="+", default=list(TARGETS),
                   help="targets to build for (default: qcom/adreno-opencl and the Adreno 540 "
                   "limits; add targets/h100_opencl.json to see the desktop build beside them)")
    args = p.parse_args(argv)
    sizes = SMALL if args.small else FULL
    bad = 0
    for name in args.models.split(","):
        for target in args.targets:
            row = check_build(name, sizes[name], target, args.batch, args.seed)
            bad += not (row["step_ok"] and row["inference_rel_err"] < 1e-4)
            line = json.dumps(row)
            print(line, flush=True)
            if args.out:
                with open(args.out, "a") as f:
                    f.write(line + "\n")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
