"""Options and helpers that several verbs share: the model, target and device-server options."""

from __future__ import annotations

import argparse
import os
import time


DEFAULT_LOG_ROOT = "tuning_logs"


def add_model_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model")
    g.add_argument("--model", default="mobilenet_v2",
                   help="mobilenet_v2, mobilenet_v1 or alexnet (default: mobilenet_v2)")
    g.add_argument("--width", type=float, default=0.35, help="width multiplier (default 0.35)")
    g.add_argument("--resolution", type=int, default=64, help="input size in pixels (default 64)")
    g.add_argument("--classes", type=int, help="number of classes (default 10; with "
                   "--checkpoint, a different number replaces the classifier head)")
    g.add_argument("--checkpoint", help="a .npz checkpoint: its architecture, shape and weights "
                   "replace --model/--width/--resolution")
    g.add_argument("--batch", type=int, default=8, help="images per training step (default 8)")
    g.add_argument("--infer-batch", type=int, default=1, help="batch of the inference module")
    g.add_argument("--trainable", default="all",
                   help="'all' or 'last:K' (the last K layers train, the rest are frozen, "
                        "their BatchNorms in inference form); ',train-bn' after last:K keeps "
                        "the frozen layers' BatchNorms in training form (their statistics "
                        "adapt), ',frozen-bn' after either keeps every BatchNorm in inference "
                        "form")
    g.add_argument("--from-scratch", action="store_true",
                   help="fresh random weights even if --checkpoint is given (all trainable)")
    g.add_argument("--optimizer", default="momentum_sgd", choices=["momentum_sgd", "sgd", "adam"])
    g.add_argument("--lr", type=float, default=0.01, help="learning rate (default 0.01)")
    g.add_argument("--momentum", type=float, default=0.9)
    g.add_argument("--weight-decay", type=float, default=0.0)


def add_cache_features_arg(p, what: str) -> None:
    p.add_argument("--cache-features", action="store_true",
                   help=f"with --trainable last:K: {what} the frozen layers apart from the "
                        "last K, so that 'train --cache-features' computes their output once "
                        "per image and trains the last K layers on it")


def add_target_arg(p, default="llvm"):
    p.add_argument("--target", default=default,
                   help="llvm, opencl, a tag such as qcom/adreno-opencl, or a JSON dict "
                        f"(default {default})")
    if "--host" in p._option_string_actions:  # rpc server: --host is its bind address
        return
    p.add_argument("--host", help="where the compiled code runs: android-aarch64 (a phone), "
                   "linux-aarch64, native, or an llvm triple; a foreign host is linked with "
                   "the cross compiler TVM_NDK_CC names (default: this machine)")


def add_remote_args(p) -> None:
    g = p.add_argument_group("device server (run the export there, e.g. on a phone)")
    g.add_argument("--tracker", help="tracker HOST:PORT of the device server")
    g.add_argument("--key", help="device key of the server (e.g. galaxy-s8)")
    g.add_argument("--wait", type=float, default=60,
                   help="seconds to wait for a free server (default 60)")
    g.add_argument("--session-timeout", type=float, default=None,
                   help="seconds each RPC session may last, sent in whole seconds (default "
                        "900; 0 is refused: every session has a bound); a longer run renews "
                        "its session between steps, state kept")
    add_profile_arg(g)


def add_memory_budget_arg(p, what: str) -> None:
    p.add_argument("--memory-budget", type=float, metavar="MB",
                   help=f"device memory the training step may hold, in MB (10^6 bytes): "
                   f"{what} (tensors of the forward pass computed again in the backward "
                   "instead of kept; refused with the smallest budget that fits when none does)")


def budget_bytes(mb: float | None) -> int | None:
    """``--memory-budget`` MB as bytes (None stays None). Raises ValueError for a budget that
    is not positive."""
    if mb is None:
        return None
    if mb <= 0:
        raise ValueError(f"--memory-budget {mb:g}: give a positive number of MB")
    return int(round(mb * 1e6))


def add_profile_arg(p, default: str = "the export's device_profile.json when its key is "
                    "--key's", use: str = "the export's tensors and kernels are checked "
                    "against its limits before the first step") -> None:
    p.add_argument("--device-profile", help="a device profile (thomas-tune rpc probe --out): "
                   f"{use} (default: {default})")


def check_profile_for_run(args, mode: str) -> None:
    """Check ``--export`` against ``--device-profile``, or against the export's own profile
    when it is of ``--key``'s device (:func:`thomas_tune.limits.check_before_run`), before
    anything runs. Raises DeviceLimitError naming the tensor or kernel and the fix."""
    from ..limits import check_before_run, find_profile
    path = getattr(args, "device_profile", None)
    if path is None and getattr(args, "key", None):
        found = find_profile(args.export)
        if found is not None:
            import json
            with open(found) as f:
                path = found if json.load(f).get("key") == args.key else None
    if path is not None:
        check_before_run(args.export, mode, path)


def open_session(args, checkpoint: str | None = None, seed: int = 0, mode: str = "train"):
    """The export of ``--export`` loaded here, or on a device server of ``--tracker``/``--key``;
    started from ``checkpoint``'s weights (and class names) when given; first checked against
    a device profile (:func:`check_profile_for_run`, ``mode``: ``train`` or ``infer``)."""
    from ..remote import RemoteDevice
    from ..runtime import Session
    check_profile_for_run(args, mode)
    remote = None
    if args.tracker or args.key:
        if not (args.tracker and args.key):
            raise ValueError("--tracker and --key go together: the tracker's HOST:PORT and "
                             "the device key of the server to run on")
        from ..rpc import parse_address, whole_seconds
        if args.session_timeout is not None:  # 0 refused: every session has a stated bound
            whole_seconds(args.session_timeout, "--session-timeout")
        remote = RemoteDevice(parse_address(args.tracker), args.key, args.session_timeout,
                              wait_s=args.wait)
    session = Session(args.export, remote=remote, seed=seed)
    if checkpoint:
        session.load_checkpoint(checkpoint)
    return session


def load_model(args):
    from ..models import build, init_params, load_checkpoint, replace_head
    classes = None
    if args.checkpoint:
        model, tensors, classes = load_checkpoint(args.checkpoint)
        if args.classes and args.classes != model.num_classes:
            model, tensors = replace_head(model, tensors, args.classes,
                                          seed=getattr(args, "seed", 0))
            classes = None
    else:
        model = build(args.model, num_classes=args.classes or 10, resolution=args.resolution,
                      width=args.width)
        tensors = init_params(model)
    if args.from_scratch:
        tensors = init_params(model, seed=int(time.time()) % 100000)
        args.trainable = "all"
    return model, tensors, classes


def optimizer_config(args):
    from ..training_graph.optimizers import OptimizerConfig
    return OptimizerConfig(name=args.optimizer, lr=args.lr, momentum=args.momentum,
                           weight_decay=args.weight_decay)


def add_precision_arg(p) -> None:
    p.add_argument("--precision", default="float32",
                   choices=["float32", "mixed16", "autocast16"],
                   help="float32 (default), or mixed16: the activations the step keeps between "
                   "kernels stored as float16 and read back as float32, arithmetic, weights, "
                   "gradients, optimizer state and BatchNorm statistics in float32; or "
                   "autocast16 (PyTorch's autocast float16, only for a device that reports "
                   "cl_khr_fp16: the target's device family or --device-profile says so): "
                   "convolutions and matrix products on float16 operands accumulating in "
                   "float32, element-wise layers in float16, BatchNorm statistics, loss, "
                   "gradients and weights in float32 (each precision's kernels are workloads "
                   "of their own)")


def add_loss_scale_args(p) -> None:
    from ..loss_scale import LOSS_SCALES
    p.add_argument("--loss-scale", default="none", choices=list(LOSS_SCALES),
                   help="with --precision mixed16: dynamic stores the backward's activation "
                   "gradients as float16 too, the loss's gradient multiplied by a scale chosen "
                   "as PyTorch's GradScaler does (a step with gradients not finite skipped and "
                   "the scale halved; doubled after --growth-interval finite steps in a row); "
                   "none (default): activation gradients in float32")
    p.add_argument("--init-scale", type=float, default=2.0 ** 16,
                   help="the first loss scale (default 65536, GradScaler's)")
    p.add_argument("--growth-interval", type=int, default=2000,
                   help="finite steps in a row after which the scale doubles (default 2000)")


def loss_scale_of(args):
    """The :class:`thomas_tune.loss_scale.LossScale` of ``--loss-scale dynamic``, or None."""
    from ..loss_scale import LossScale
    if getattr(args, "loss_scale", "none") != "dynamic":
        return None
    return LossScale(init_scale=args.init_scale, growth_interval=args.growth_interval)


def model_graphs(args, model):
    """The inference and training modules whose tasks ``tasks``, ``tune``, ``remeasure`` and
    ``log`` work on: {"infer": IRModule, "train": IRModule}, at ``--precision`` (with
    ``--loss-scale dynamic``, the loss-scaled step's module as an export compiles it,
    :func:`thomas_tune.memory_plan.step_graph` then ``training_library_module``: its
    backward's float16-reading kernels are workloads of their own, fused as in the export).
    Raises ValueError as ``step_graph``."""
    from ..training_graph import graph as G
    from ..half_arith import apply_precision
    precision = getattr(args, "precision", "float32")
    tg = G.training_module(model, args.batch, args.trainable, optimizer_config(args),
                           features=getattr(args, "cache_features", False))
    train, infer = apply_precision(precision, tg.mod,
                                   G.inference_module(model, args.infer_batch), args.batch,
                                   args.infer_batch)
    scale = loss_scale_of(args)
    if scale is not None:  # as the export's library: its fusion of the backward is that one's
        from ..memory_plan import step_graph
        from ..training_graph.library_module import training_library_module
        train = training_library_module(step_graph(tg, args.batch, None, precision, scale))[0]
    return {"infer": infer, "train": train}


def model_tag(model, args) -> str:
    return (f"{model.arch}-w{model.width:g}-r{model.resolution}-c{model.num_classes}"
            f"-b{args.batch}")


def default_log(args, model, key):
    return os.path.join(DEFAULT_LOG_ROOT, key, model_tag(model, args))
