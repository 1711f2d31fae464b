"""The ``bench`` verb: tuned against default schedules against PyTorch, on one device."""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time

from .options import (add_model_args, add_remote_args, add_target_arg, load_model,
                      open_session, optimizer_config)


def _check_on_device(args, session):
    """The export's training step run on ``session``'s device server, through the library the
    session loaded (no second load there), and checked against PyTorch float64
    (:func:`thomas_tune.export_check.check_export`, from the export's own parameters): the
    StepCheck, said on stderr; None, said too, where PyTorch is not installed (the times are
    then of an unchecked build)."""
    try:
        import torch  # noqa: F401
    except ImportError:
        print("[bench] PyTorch is not installed: the export's numbers on the device are not "
              "checked; its times are of an unchecked build", file=sys.stderr)
        return None
    from ..export_check import check_export
    check = check_export(args.export, seed=args.seed, rpc_session=session.rpc_session,
                         train_lib=session.train_library)
    print(f"[bench] numbers on the device against PyTorch float64: {check.line()}",
          file=sys.stderr)
    return check


def _bench_remote(args) -> int:
    """``bench --export E --tracker HOST:PORT --key KEY``: check E's training step on that
    device server against PyTorch float64 (:func:`_check_on_device`; a wrong build is not
    timed: exit 1), then time its training steps and inference there (wall time here, RPC
    round trips included)."""
    import numpy as np
    from ..runtime import time_steps
    if not args.export:
        raise ValueError("bench on a device server needs --export (an export for that "
                         "device, e.g. made with --host android-aarch64)")
    session = open_session(args, args.checkpoint, seed=args.seed)
    checked = _check_on_device(args, session)
    if checked is not None and not checked.ok:
        print(f"FAIL: the export's numbers on the device are wrong, not timed: {checked.line()}",
              file=sys.stderr)
        return 1
    rng = np.random.default_rng(args.seed)
    x = rng.standard_normal(session.model.input_shape(session.batch)).astype("float32")
    y = rng.integers(0, session.model.num_classes, session.batch)
    session.train_step(x, y)  # warm-up
    ms = time_steps(session, x, y, args.steps)
    t0 = time.perf_counter()
    for _ in range(args.steps):
        session.predict(x[: session.infer_batch])
    infer_ms = (time.perf_counter() - t0) * 1e3 / args.steps
    print(json.dumps({"export": args.export, "device_key": args.key, "batch": session.batch,
                      "ms_per_training_step": round(ms, 3),
                      "ms_per_inference": round(infer_ms, 3),
                      "checked": checked.as_dict() if checked is not None else None}))
    return 0


def cmd_bench(args) -> int:
    """Side by side on this machine's device: the model compiled with --log (tuned) and with
    default schedules, PyTorch eager and, with --torch-compile, PyTorch with torch.compile;
    see :mod:`thomas_tune.benchmark`. With --tracker/--key: one export timed on that device
    server (``_bench_remote``)."""
    if args.tracker or args.key:
        return _bench_remote(args)
    from .. import benchmark as bench
    from ..target import parse_target
    work = args.work or tempfile.mkdtemp(prefix="thomas-tune-bench-")
    if args.export:  # one existing export: its model, shapes, target and trainable set
        from ..manifest import Manifest
        from ..training_graph.graph import OptimizerConfig
        from ..models import load_checkpoint
        m = Manifest.read(args.export)
        model, tensors, _ = load_checkpoint(os.path.join(args.export, "params.npz"))
        target = parse_target(m.target)
        trainable = m.trainable
        opt = m.optimizer
        optimizer = OptimizerConfig(**{**opt, "betas": tuple(opt["betas"])})
        log = args.log or (m.tuning_log if m.tuning_log and
                           os.path.isdir(m.tuning_log) else None)
        exports = {"tuned" if m.tuning_log else "default": args.export}
    else:
        model, tensors, _ = load_model(args)
        target = parse_target(args.target)
        trainable, optimizer, log = args.trainable, optimizer_config(args), args.log
        exports = bench.prepare_exports(model, tensors, target, log, work, args.batch,
                                        args.infer_batch, trainable, optimizer,
                                        stock=args.stock_defaults)
    cfg = bench.BenchConfig(steps=args.steps, warmup=args.warmup, kernels=args.kernels,
                            kernel_min_ms=args.kernel_min_ms, startup=not args.no_startup,
                            torch=not args.no_torch, torch_compile=args.torch_compile,
                            refresh_peaks=args.refresh_peaks,
                            seed=args.seed, progress=not args.quiet)
    res = bench.run_bench(model, tensors, target, exports, cfg, log, trainable, optimizer)
    res["exports"] = exports
    out_json = args.json or os.path.join(work, "bench.json")
    curve = res.get("tuning_curve")
    if curve:
        png = args.plot or os.path.splitext(out_json)[0] + "-tuning-curve.png"
        m = res["model"]
        res["tuning_curve_png"] = bench.plot_curve(
            curve, png, f"{m['arch']} w{m['width']:g} r{m['resolution']} c{m['num_classes']} "
                        f"b{res['batch']} {res['trainable']}\n{res['device']}")
    os.makedirs(os.path.dirname(os.path.abspath(out_json)), exist_ok=True)
    with open(out_json, "w") as f:
        json.dump(res, f, indent=1, default=float)
    print(bench.format_report(res, top=args.kernels or 12))
    print(f"\nwritten: {out_json}" + (f", {res['tuning_curve_png']}"
                                      if res.get("tuning_curve_png") else ""))
    return 0


def add_bench(sub) -> None:
    s = sub.add_parser("bench", help="side by side on one device: tuned vs default schedules "
                       "vs PyTorch eager; kernels, peaks, start-up, tuning curve")
    add_model_args(s)
    add_target_arg(s)
    add_remote_args(s)
    s.add_argument("--log", help="tuning log of the tuned variant (none: default schedules and "
                   "PyTorch only)")
    s.add_argument("--export", help="bench this export instead of compiling the model options")
    s.add_argument("--work", help="folder for the exports and the JSON (default: a temp folder; "
                   "exports already there with the same settings are reused)")
    s.add_argument("--steps", type=int, default=20, help="timed training steps and inference "
                   "passes per variant (median; default 20)")
    s.add_argument("--warmup", type=int, default=2, help="untimed runs first (default 2)")
    s.add_argument("--kernels", type=int, default=12, help="rows of the kernel table; 0 skips "
                   "timing each kernel (default 12)")
    s.add_argument("--kernel-min-ms", type=float, default=1.0,
                   help="length of one timed repeat of a kernel (default 1 ms)")
    s.add_argument("--no-startup", action="store_true",
                   help="skip the first/second start measurement (OpenCL)")
    s.add_argument("--no-torch", action="store_true", help="skip PyTorch eager")
    s.add_argument("--torch-compile", action="store_true",
                   help="also PyTorch with torch.compile (inductor), the same network and "
                   "training step, compiled before timing (its compile time is reported apart) "
                   "and checked as the builds are; where it cannot compile (no C++ compiler "
                   "on the CPU, say) the cause is printed and the side skipped")
    s.add_argument("--stock-defaults", action="store_true",
                   help="also a variant whose kernels get TVM's own default GPU schedules "
                   "(dlight's rules) instead of thomas_tune's: what tuning gains over TVM "
                   "untuned")
    s.add_argument("--refresh-peaks", action="store_true",
                   help="measure the device's peak FLOP/s and bandwidth again")
    s.add_argument("--json", help="result file (default WORK/bench.json)")
    s.add_argument("--plot", help="tuning-curve PNG (default next to the JSON; needs "
                   "matplotlib)")
    s.add_argument("--quiet", action="store_true", help="no progress bars")
    s.add_argument("--seed", type=int, default=0)
    s.set_defaults(fn=cmd_bench)
