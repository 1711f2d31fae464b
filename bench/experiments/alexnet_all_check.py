"""Why AlexNet@224 `all` fails the step check on `features.0.weight`: the Winograd data
gradients against the direct form, and half storage's yardstick at the README rows' size.

    python3 bench/experiments/alexnet_all_check.py LOG_FOLDER OUT_FOLDER [--target T.json]

On the GPU machine (``tools/gpu_tune.sh setup`` first, then ``tools/gpu_tune.sh py`` this):
exports AlexNet 1.0@224, 1000 classes, batch 32, every layer, from the committed tuning log
twice: as the README row is built (the log's Winograd choice for the 3x3 data gradients) and
with no Winograd form at all; checks both (``export_check.check_export``, seed 0) and prints
every parameter's error, bound and PyTorch float32's error. Then PyTorch's own half-storage
float32 step against its float64 step (``reference_steps(precision="mixed16")``) for
MobileNetV2 1.0@224 and AlexNet 1.0@224 at batch 32, every layer: the errors that set a mixed16
build's bounds there. Writes OUT_FOLDER/alexnet_all_check.json.
"""

from __future__ import annotations

import argparse
import json
import os
import time


def _export(out, log, target, direct):
    import thomas_tune.compiler.build_plan as C
    from thomas_tune.cli.main import main
    plain = C.winograd_choice  # the name the build plan calls
    if direct:
        C.winograd_choice = lambda *a, **k: set()
    try:
        rc = main(["export", "--model", "alexnet", "--trainable", "all", "--width", "1.0",
                   "--resolution", "224", "--classes", "1000", "--batch", "32", "--target",
                   target, "--any-codegen", "--log", log, "--out", out])
    finally:
        C.winograd_choice = plain
    assert rc in (0, None), rc
    return out


def _rows(check):
    return {n: {"error": check.errors[n], "bound": check.bounds[n],
                "torch_float32": check.yardstick.get(n)} for n in check.errors}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("log")
    p.add_argument("out")
    p.add_argument("--target", default="targets/h100_opencl.json")
    a = p.parse_args()
    os.makedirs(a.out, exist_ok=True)
    from thomas_tune.manifest import Manifest
    from thomas_tune.export_check import check_export
    res = {}
    for name, direct in (("winograd", False), ("direct", True)):
        t0 = time.time()
        d = _export(os.path.join(a.out, f"alexnet_all_{name}"), a.log, a.target, direct)
        m = Manifest.read(d)
        c = check_export(d, seed=0, say=lambda line: print(line, flush=True))
        res[name] = {"line": c.line(), "ok": c.ok, "winograd": m.winograd,
                     "params": _rows(c), "seconds": time.time() - t0}
        print(f"== {name}: {c.line()}", flush=True)
        print(c.table(), flush=True)
    from thomas_tune.models import build, init_params
    from thomas_tune.step_check import reference_steps
    from thomas_tune.trainable import select_trainable
    for arch in ("mobilenet_v2", "alexnet"):
        model = build(arch, num_classes=1000, resolution=224, width=1.0)
        for precision in ("float32", "mixed16"):
            t0 = time.time()
            ref = reference_steps(model, init_params(model, seed=3),
                                  select_trainable(model, "all"), 32, 0, precision=precision)
            y = ref["yardstick"]
            res[f"yardstick_{arch}_{precision}"] = {
                "line": y.line(), "errors": y.errors, "loss_err": y.loss_err,
                "seconds": time.time() - t0}
            print(f"== yardstick {arch} {precision}: {y.line()}", flush=True)
    with open(os.path.join(a.out, "alexnet_all_check.json"), "w") as f:
        json.dump(res, f, indent=1, default=str)


if __name__ == "__main__":
    main()
