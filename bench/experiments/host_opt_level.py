"""What LLVM's optimisation of a GPU target's host code costs an export, and what it buys a launch.

The host code of an OpenCL build is one wrapper per kernel (argument checks and unpacking, the
launch). This script compares the host at LLVM ``opt-level`` 3 (a host dict that names it) with
the host at 0 (``thomas_tune.target.codegen_target``'s default), on the local OpenCL device
(PoCL in CI), in one process:

- ``export_s``: ``thomas_tune.compiler.export.export`` of the model's inference and training
  modules, seconds, the two levels alternated ``--rounds`` times (the first export of a process also
  pays its imports and warm-up: drop it);
- ``loss``: the first training step's loss of each export on the same batch (the kernels are the
  same code, so the losses must be equal);
- ``step_ms``: training steps alternated between the two exports, ms (median, min);
- ``call_us``: one small kernel (7 arguments) launched ``--calls`` times in a row and then
  synchronised, microseconds per launch (median and min of ``--reps``): the wrapper's cost
  plus the device API's enqueue.

    python bench/experiments/host_opt_level.py --out /tmp/host-opt
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np


def _with_host_level(target, level: int):
    import tvm
    return tvm.target.Target(target, host=dict(target.host.export(), **{"opt-level": level}))


def _launch_us(targets: dict, calls: int, reps: int) -> dict:
    import tvm
    from tvm import te
    n = 64
    inputs = [te.placeholder((n, n), name=f"a{i}") for i in range(6)]
    out = te.compute((n, n), lambda i, j: sum(a[i, j] for a in inputs), name="b")
    sch = tvm.s_tir.Schedule(te.create_prim_func(inputs + [out]))
    i, j = sch.get_loops(sch.get_sblock("b"))
    bx, tx = sch.split(sch.fuse(i, j), [None, 64])
    sch.bind(bx, "blockIdx.x")
    sch.bind(tx, "threadIdx.x")
    funcs = {name: tvm.compile(sch.mod, target=t)["main"] for name, t in targets.items()}
    dev = tvm.opencl(0)
    rng = np.random.default_rng(0)
    args = [tvm.runtime.tensor(rng.random((n, n), dtype="float32"), dev) for _ in range(7)]
    per_call: dict[str, list[float]] = {name: [] for name in funcs}
    for _ in range(reps):
        for name, fn in funcs.items():
            for _ in range(200):
                fn(*args)
            dev.sync()
            t0 = time.perf_counter()
            for _ in range(calls):
                fn(*args)
            dev.sync()
            per_call[name].append((time.perf_counter() - t0) / calls * 1e6)
    return {name: {"median": statistics.median(v), "min": min(v)} for name, v in per_call.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="mobilenet_v1")
    ap.add_argument("--width", type=float, default=0.25)
    ap.add_argument("--resolution", type=int, default=64)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--trainable", default="all")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--calls", type=int, default=20000)
    ap.add_argument("--reps", type=int, default=12)
    ap.add_argument("--out", required=True, help="folder for the exports")
    a = ap.parse_args()

    from thomas_tune import opencl
    from thomas_tune.compiler.export import export
    from thomas_tune.models import build, init_params
    from thomas_tune.runtime import Session
    base = opencl.target_for(0)
    targets = {"O3": _with_host_level(base, 3), "O0": _with_host_level(base, 0)}
    model = build(a.model, num_classes=10, resolution=a.resolution, width=a.width)
    params = init_params(model, seed=3)
    export_s: dict[str, list[float]] = {name: [] for name in targets}
    for r in range(a.rounds):
        for name, target in targets.items():
            t0 = time.perf_counter()
            export(f"{a.out}/{name}-{r}", model, params, target, batch=a.batch,
                   trainable=a.trainable, progress=lambda *_: None)
            export_s[name].append(round(time.perf_counter() - t0, 1))
    rng = np.random.default_rng(5)
    x = rng.standard_normal((a.batch, 3, a.resolution, a.resolution)).astype("float32")
    y = rng.integers(0, 10, a.batch)
    sessions = {name: Session(f"{a.out}/{name}-0") for name in targets}
    loss = {name: s.train_step(x, y) for name, s in sessions.items()}
    step_ms: dict[str, list[float]] = {name: [] for name in targets}
    for i in range(a.steps):
        for name in (list(targets) if i % 2 == 0 else list(targets)[::-1]):
            s = sessions[name]
            s.sync()
            t0 = time.perf_counter()
            s.train_step(x, y)
            s.sync()
            step_ms[name].append((time.perf_counter() - t0) * 1e3)
    print(json.dumps({
        "export_s": export_s, "loss": loss, "losses_equal": loss["O3"] == loss["O0"],
        "step_ms": {k: {"median": statistics.median(v[5:]), "min": min(v[5:])}
                    for k, v in step_ms.items()},
        "call_us": _launch_us(targets, a.calls, a.reps)}, indent=1))


if __name__ == "__main__":
    main()
