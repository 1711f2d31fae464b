"""Where a training step's wall time goes, for an export on this machine's device.

    python3 bench/experiments/step_split.py EXPORT_DIR [--steps 20]

Times, as medians over ``--steps`` steps (ms), each part of ``Session.train_step`` alone, the
device drained before and after each (so the parts add up to more than a pipelined step):
the batch's copy to the device, drawing the dropout masks (on the device), the forward and
backward pass (the adjoint function), the optimizer update, reading the loss back; then the step
with the batch already on the device, as ``thomas-tune bench`` times it. The gap between that
and the bench's kernel sum (kernels timed alone) is time outside the kernels, or kernels slower
in the step than alone.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("export_dir")
    ap.add_argument("--steps", type=int, default=20)
    args = ap.parse_args()

    from thomas_tune.runtime import ADJOINT, OPTIMIZER, Session

    s = Session(args.export_dir)
    m = s.manifest
    rng = np.random.default_rng(0)
    parts: dict[str, list[float]] = {k: [] for k in (
        "upload", "masks", "adjoint", "optimizer", "loss readback", "step (batch on device)")}

    def clock(name, fn):
        s.sync()
        t0 = time.perf_counter()
        out = fn()
        s.sync()
        parts[name].append((time.perf_counter() - t0) * 1e3)
        return out

    for i in range(args.steps + 2):
        x = rng.standard_normal(s.model.input_shape(s.batch)).astype("float32")
        y = rng.integers(0, s.model.num_classes, s.batch)
        xd, yd = clock("upload", lambda: s.upload(x, y))
        masks = clock("masks", s.draw_masks)
        call = s._step_args(ADJOINT, xd, yd, masks)
        ret, grads = clock("adjoint", lambda: s._train_vm[ADJOINT](*call))
        loss = ret[0] if m.states else ret
        clock("optimizer", lambda: s._train_vm[OPTIMIZER](s._ordered(m.trainable), grads,
                                                          s._opt))
        clock("loss readback", lambda: float(loss.numpy()))
        clock("step (batch on device)", lambda: s.train_step(xd, yd))
        if i < 2:  # warm-up
            for v in parts.values():
                v.clear()
    out = {k: float(np.median(v)) for k, v in parts.items()}
    for k, v in out.items():
        print(f"{k:24s} {v:8.3f} ms")
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
