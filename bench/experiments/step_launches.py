"""Kernel launches per training step of an export, counted on this machine's OpenCL device.

    python bench/experiments/step_launches.py --model mobilenet_v2 --width 1.0 --resolution 224 \
        --classes 1000 --batch 32 --trainable all --target targets/h100_opencl.json \
        --log tuning_logs/h100/mobilenet_v2-w1-r224-c1000-b32

Exports the model with fresh random weights for ``--target`` with ``--log``'s records (not
checked: the kernels are not timed here), loads it on OpenCL device 0 (PoCL in CI), runs one
step, then counts the launches of a second one (``thomas_tune.opencl.stats``) and lists the
step's calls that launch more than one kernel (``--calls``: every call). A build for another
device's target runs on this one as it would there, launch for launch.
"""

import argparse
import collections
import os
import sys
import tempfile

import numpy as np

from thomas_tune import opencl
from thomas_tune.compiler.export import export
from thomas_tune.logs import TuningLog
from thomas_tune.models import build
from thomas_tune.runtime import Session
from thomas_tune.target import parse_target

sys.path.insert(0, os.path.join(os.path.abspath(os.path.join(__file__, "../../..")),
                                "tests"))
from conftest import random_tensors  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="mobilenet_v2")
    ap.add_argument("--width", type=float, default=1.0)
    ap.add_argument("--resolution", type=int, default=224)
    ap.add_argument("--classes", type=int, default=1000)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--trainable", default="all")
    ap.add_argument("--target", default="targets/h100_opencl.json")
    ap.add_argument("--log", default=None)
    ap.add_argument("--calls", action="store_true",
                    help="list every call of the step, not only those of several launches")
    a = ap.parse_args()
    model = build(a.model, width=a.width, resolution=a.resolution, num_classes=a.classes)
    rng = np.random.default_rng(0)
    out = tempfile.mkdtemp()
    export(out, model, random_tensors(model, rng), parse_target(a.target),
           log=TuningLog(a.log) if a.log else None, check_records=False, batch=a.batch,
           infer_batch=1, trainable=a.trainable, progress=lambda *_: None)
    s = Session(out)
    calls, launched, before = collections.Counter(), {}, [0]

    def instrument(func, sym, is_before, ret, *args):
        if sym.startswith("vm."):
            return 0
        if is_before:
            calls[sym] += 1
            before[0] = opencl.stats()["launches"]
        else:
            launched[sym] = opencl.stats()["launches"] - before[0]
        return 0

    s._train_vm.set_instrument(instrument)
    x = rng.standard_normal(model.input_shape(a.batch)).astype("float32")
    y = rng.integers(0, model.num_classes, a.batch)
    s.train_step(x, y)  # the first step also runs what is lifted out of it
    s.sync()
    calls.clear()
    start = opencl.stats()["launches"]
    s.train_step(x, y)
    s.sync()
    print(f"{a.model} {a.trainable}: {opencl.stats()['launches'] - start} launches a step, "
          f"{sum(calls.values())} calls")
    for name, n in calls.most_common():
        if a.calls or launched.get(name, 1) > 1:
            print(f"  {n} x {name}: {launched.get(name, 0)} launches a call")


if __name__ == "__main__":
    main()
