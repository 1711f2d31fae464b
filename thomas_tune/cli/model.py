"""The verbs about a model itself: ``import-onnx`` (pretrained weights) and ``memory``."""

from __future__ import annotations

import json
import re

from .options import (add_loss_scale_args, add_memory_budget_arg, add_model_args,
                      add_precision_arg, add_target_arg, load_model, loss_scale_of,
                      optimizer_config)


def cmd_import_onnx(args) -> int:
    from ..models import save_checkpoint
    from ..models.fused_advice import fused_import_advice
    from ..models.onnx_import import import_onnx
    model, tensors, report = import_onnx(args.onnx, args.model, width=args.width,
                                         resolution=args.resolution, num_classes=args.classes,
                                         seed=args.seed)
    cal = None
    if args.calibrate and report.fused_batchnorms:
        from ..data import load
        from ..models.calibration import calibrate_batchnorms
        import numpy as np
        x = load(args.calibrate, model.resolution, limit=args.calibrate_images, seed=args.seed).x
        images = x[np.random.default_rng(args.seed).permutation(len(x))[:args.calibrate_images]]
        tensors, cal = calibrate_batchnorms(model, tensors, images, report.fused_batchnorms)
    save_checkpoint(args.out, model, tensors)
    print(f"imported {report.layers} layers of {args.onnx} into {model.arch} "
          f"(width {model.width:g}, {model.resolution}x{model.resolution}, "
          f"{model.num_classes} classes) -> {args.out}")
    n_fused = len(report.fused_batchnorms)
    if cal is not None:
        print(f"  {n_fused} BatchNorm layers were fused into their convolutions in the file: "
              f"calibrated on {cal.images} images of {args.calibrate} (scale, shift and "
              "running statistics from the per-channel mean and variance of each layer's "
              "input; inference output unchanged, max relative change "
              f"{cal.logits_change:.1e})")
    elif n_fused:
        print(f"  {n_fused} BatchNorm layers were fused into their convolutions in the file: "
              "imported as identity BatchNorms (same inference output)")
    if n_fused:
        print("  which way to fine-tune it (measured: docs/fine-tuning-imported.md):")
        for line in fused_import_advice():
            print(f"    {line}")
    elif args.calibrate:
        print("  no BatchNorm was fused in the file (statistics imported): nothing to "
              "calibrate")
    if report.replaced_head:
        print(f"  classifier head {report.replaced_head} replaced: {report.onnx_classes} -> "
              f"{model.num_classes} classes, freshly initialised")
    return 0


def _rewrite(args):
    """The function rewrite of ``--precision`` (``--loss-scale dynamic``: activation gradients
    stored as float16 too, :func:`thomas_tune.half_grads.rewrite_function`)."""
    from ..half_arith import rewrite_for
    if loss_scale_of(args) is not None:
        from ..loss_scale import require_mixed16
        require_mixed16(args.precision)
        from ..half_grads import rewrite_function
        return rewrite_function
    return rewrite_for(args.precision)


def cmd_memory(args) -> int:
    from ..memory import training_memory
    from ..memory_plan import compiled_step_memory
    from .options import budget_bytes
    model, _, _ = load_model(args)
    modes = args.modes.split(",") if args.modes else [args.trainable]
    budget = budget_bytes(args.memory_budget)
    if budget is not None and len(modes) > 1:
        raise ValueError("--memory-budget plans one trainable set: give --trainable, not "
                         "--modes")
    records = _log_records(args)
    if budget is not None:
        return _memory_plan(args, model, modes[0], budget, records)
    rows = []
    for mode in modes:
        m = training_memory(model, args.batch, mode, optimizer_config(args),
                            features=args.cache_features, precision=args.precision,
                            rewrite=_rewrite(args)).as_dict()
        # the compiled step's own plan (memory_plan); the step on cached features has none
        m["compiled_peak"] = None if args.cache_features else compiled_step_memory(
            model, args.batch, mode, optimizer_config(args), precision=args.precision,
            loss_scale=loss_scale_of(args), database=records["database"],
            target=records["target"]).peak
        rows.append({"trainable": mode, "precision": args.precision,
                     "loss_scale": args.loss_scale, **m})
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    keys = ["parameters", "gradients", "optimizer_state", "activations_kept", "peak",
            "compiled_peak"]
    print(f"{model.arch} w{model.width:g} r{model.resolution} batch {args.batch}, "
          f"{args.precision}{', loss-scaled' if args.loss_scale == 'dynamic' else ''}, MiB; "
          "peak: "
          "the training graph's tensors by liveness; compiled_peak: what the compiled step "
          "holds on the device")
    print(f"{'trainable':>10}" + "".join(f"{k:>18}" for k in keys))
    for r in rows:
        print(f"{r['trainable']:>10}" + "".join(
            f"{'-' if r[k] is None else format(r[k] / 2**20, '.2f'):>18}" for k in keys))
    return 0


def _log_records(args) -> dict:
    """``memory --log``: the records an export with that tuning log applies for ``--target``
    (their kernels' scratch buffers counted) and what leaving each out costs (the budget
    may leave some out, as the export does); None values without ``--log``."""
    if not args.log:
        return {"database": None, "target": None, "gain": None}
    from ..compiler.compile import record_gains, tuned_build
    from ..logs import TuningLog
    from ..target import parse_target
    target, log = parse_target(args.target, args.host), TuningLog(args.log)
    database, _, kernel_ms = tuned_build(log, target)
    return {"database": database, "target": target,
            "gain": record_gains(log, target, kernel_ms)}


def _memory_plan(args, model, mode: str, budget: int, records: dict) -> int:
    """``memory --memory-budget``: the recomputation plan that fits (what is kept, what is
    recomputed, bytes saved, FLOPs added, tuning records left out for their scratch buffers),
    or the refusal naming the smallest budget."""
    from ..memory_plan import plan_for_budget
    plan, tried = plan_for_budget(model, args.batch, mode, optimizer_config(args), budget,
                                  precision=args.precision, loss_scale=loss_scale_of(args),
                                  database=records["database"], target=records["target"],
                                  record_gain=records["gain"])
    chosen = next(t for t in tried if t["level"] == plan.level)
    if args.json:
        print(json.dumps({"trainable": mode, "precision": args.precision,
                          "budget_bytes": budget, "tried": tried,
                          "plan": plan.as_dict()}, indent=1))
        return 0
    print(f"{model.arch} w{model.width:g} r{model.resolution} batch {args.batch}, trainable "
          f"{mode}, {args.precision}{', loss-scaled' if loss_scale_of(args) else ''}: memory "
          f"budget {budget / 1e6:.1f} MB")
    for t in tried:
        print(f"  {t['level']:>12} recomputation: peak {t['peak_bytes'] / 1e6:.2f} MB, "
              f"{t['saved_bytes'] / 1e6:.2f} MB saved, {t['flops_added'] / 1e9:.4f} GFLOP "
              f"added, {t['recomputed']} tensors recomputed, {t['kept_bytes'] / 1e6:.2f} MB "
              "kept from the forward for the backward")
    print(f"plan: {plan.level} (fits: {chosen['peak_bytes'] / 1e6:.2f} MB)")
    for v in chosen["records_left_out"].values():
        print(f"  tuning record left out: {v['kernel']} ({v['scratch_bytes'] / 1e6:.2f} MB of "
              f"scratch buffers; its default schedule adds {v['ms_added']:.3f} ms per step)")
    by_op: dict = {}
    for r in plan.recomputed:
        op = re.sub(r"\d+$", "", r.op)  # bn_act7 -> bn_act: one kernel per shape
        n, b, f = by_op.get(op, (0, 0, 0))
        by_op[op] = (n + 1, b + r.bytes, f + r.flops)
    for op, (n, b, f) in sorted(by_op.items()):
        print(f"  recomputed: {n} outputs of {op} ({b / 1e6:.2f} MB no longer kept from the "
              f"forward to the backward, {f / 1e9:.4f} GFLOP)")
    print(f"  kept: {chosen['kept_bytes'] / 1e6:.2f} MB, every other forward tensor the "
          "backward reads (the BatchNorms' inputs and batch statistics, the residual sums, "
          "what feeds the loss)")
    return 0


def add_import_onnx(sub) -> None:
    s = sub.add_parser("import-onnx", help="pretrained weights from an ONNX file -> checkpoint")
    s.add_argument("onnx", help="ONNX file with the torchvision layer layout")
    s.add_argument("--model", required=True, help="mobilenet_v2, mobilenet_v1 or alexnet")
    s.add_argument("--width", type=float, default=1.0, help="width multiplier (default 1.0)")
    s.add_argument("--resolution", type=int, help="input size (default: the ONNX input's)")
    s.add_argument("--classes", type=int,
                   help="classes (default: the file's; another number replaces the head)")
    s.add_argument("--seed", type=int, default=0, help="seed of a replaced head")
    s.add_argument("--out", required=True, help="checkpoint .npz to write")
    s.add_argument("--calibrate", metavar="DATA", help="image folder or shipped data set: "
                   "recover the scale, shift and statistics of BatchNorms fused in the file "
                   "from these images (your fine-tuning images, when every layer will train: "
                   "docs/fine-tuning-imported.md)")
    s.add_argument("--calibrate-images", type=int, default=512,
                   help="images of --calibrate to use (default 512)")
    s.set_defaults(fn=cmd_import_onnx)


def add_memory(sub) -> None:
    s = sub.add_parser("memory", help="bytes a training step needs, by trainable set")
    add_model_args(s)
    s.add_argument("--modes", help="comma-separated trainable sets, e.g. all,last:4,last:1")
    s.add_argument("--json", action="store_true")
    s.add_argument("--cache-features", action="store_true",
                   help="the step of train --cache-features (the last K layers on cached "
                        "features, the frozen parameters resident); last:K modes only")
    add_memory_budget_arg(s, "report the plan that fits: what is kept, what is recomputed, "
                          "bytes saved, FLOPs added")
    add_precision_arg(s)
    add_loss_scale_args(s)
    s.add_argument("--log", help="a tuning log: the compiled step counts the scratch buffers "
                   "of the kernels its records schedule for --target, and a budget may leave "
                   "records out, as 'export --log' does")
    add_target_arg(s)
    s.set_defaults(fn=cmd_memory)
