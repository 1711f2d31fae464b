"""The step check of a small MobileNetV2 exported from random weights, over several seeds.

    python bench/experiments/bn_step_check.py --target qcom/adreno-opencl --batch 4 --seeds 1,2,3

Each seed draws the weights (the tests' ``random_tensors``), exports MobileNetV2 0.35@64 with 5
classes and every layer trainable for ``--target`` with default schedules, and runs
:func:`thomas_tune.export_check.check_export` with that seed: one line per seed, the check's
verdict with the worst gradient beside PyTorch float32's. PoCL is the OpenCL device.
"""

import argparse
import os
import sys
import tempfile

import numpy as np

from thomas_tune.compiler.export import export
from thomas_tune.models import build
from thomas_tune.export_check import check_export
from thomas_tune.target import parse_target

sys.path.insert(0, os.path.join(os.path.abspath(os.path.join(__file__, "../../..")),
                                "tests"))
from conftest import SMALL, random_tensors  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="qcom/adreno-opencl")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seeds", default="1,2,3")
    a = ap.parse_args()
    target = parse_target(a.target)
    for seed in (int(s) for s in a.seeds.split(",")):
        model = build("mobilenet_v2", **SMALL["mobilenet_v2"])
        tensors = random_tensors(model, np.random.default_rng(seed))
        with tempfile.TemporaryDirectory() as out:
            export(out, model, tensors, target, batch=a.batch, infer_batch=2,
                   trainable="all", progress=lambda *_: None)
            print(seed, check_export(out, seed=seed).line(), flush=True)


if __name__ == "__main__":
    main()
