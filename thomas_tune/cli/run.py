"""The verbs that run an export on data: ``train`` (fine-tuning) and ``infer``."""

from __future__ import annotations

import os
import sys
import tempfile

from .export import export_model
from .options import add_model_args, add_remote_args, add_target_arg, open_session


def _data(args, model):
    from ..data import load
    return load(args.data, model.resolution, limit=args.limit, seed=args.seed)


def _export_for_train(args) -> str:
    """``train`` without ``--export``: compile the model for its trainable set first."""
    out = args.out or tempfile.mkdtemp(prefix="thomas-tune-train-")
    manifest = export_model(args, out)
    mode = "from scratch" if args.from_scratch else f"trainable {args.trainable}"
    print(f"compiled {manifest.arch} ({mode}) into {out}", flush=True)
    return out


def _warn_identity_batchnorms(session) -> None:
    """Say so when the weights hold the identity BatchNorms of a fused ONNX import (no
    ``--calibrate``) and the export trains them another way than the advised one
    (:func:`thomas_tune.models.fused_advice.fused_import_warning`, from the manifest's BatchNorm
    mode, frozen parameters and learning rate)."""
    from ..models.fused_advice import fused_import_warning
    from ..models.calibration import identity_batchnorms
    fused = identity_batchnorms(session.model, session.tensors())
    if not fused:
        return
    m = session.manifest
    advice = fused_import_warning(m.batchnorm, not m.frozen, m.optimizer.get("lr"))
    if advice:
        print(f"warning: {len(fused)} BatchNorm layers are the identity of a fused ONNX "
              f"import: {advice}", file=sys.stderr)


def cmd_train(args) -> int:
    from ..train import divergence, fine_tune, likely_cause
    checkpoint = args.checkpoint if args.export else None  # else compiled in below
    args.export_given = bool(args.export)
    if not args.export:
        args.export = _export_for_train(args)
    session = open_session(args, checkpoint, seed=args.seed)
    data = _data(args, session.model)
    n = session.model.num_classes
    if len(data.classes) > n:
        print(f"error: data set has {len(data.classes)} classes, the model "
              f"{n}; export a model with --classes "
              f"{len(data.classes)}", file=sys.stderr)
        return 2
    # the labels are the data's class indices: its names go with the weights it trains
    session.classes = [str(c) for c in data.classes] + [str(i) for i in
                                                        range(len(data.classes), n)]
    _warn_identity_batchnorms(session)
    train, test = data.split(args.test_fraction, seed=args.seed)
    print(f"data {data.source}: {len(train.y)} training / {len(test.y)} held-out images, "
          f"{len(data.classes)} classes; {len(session.manifest.trainable)} trainable "
          f"parameters", flush=True)
    r = fine_tune(session, train, test, args.steps, seed=args.seed,
                  show_progress=not args.quiet, cache_features=args.cache_features)
    if args.cache_features:
        print(f"features of the {len(train.y)} training images computed once in "
              f"{r.features_s:.1f} s, {r.features_bytes / 2**20:.1f} MiB held in memory")
    print(f"accuracy before {100 * r.acc_before:.1f}%  after {100 * r.acc_after:.1f}%  "
          f"({r.steps} steps, loss {r.losses[0]:.3f} -> {r.losses[-1]:.3f}, "
          f"{r.ms_per_step:.1f} ms per training step)")
    if r.loss_scale is not None:  # a loss-scaled export (thomas_tune.loss_scale)
        print(f"loss scaling: {r.skipped_steps} of {r.steps} steps skipped (gradients not "
              f"finite), scale now {r.loss_scale:g}")
    signs = divergence(r, len(data.classes), len(test.y))
    if signs:  # a run that diverged is no ordinary result
        print(f"warning: the run diverged: {'; '.join(signs)}. Likely cause: "
              f"{likely_cause(session.manifest)}", file=sys.stderr)
    if session.renewals:  # sessions of --session-timeout s, renewed with the state kept
        print(f"{len(session.renewals)} session renewal(s) on the device server")
    if args.save:
        session.save(args.save)
        print(f"saved checkpoint {args.save}")
    if args.out and not args.export_given:  # the export this run compiled: keep it trained
        session.save(os.path.join(args.export, "params.npz"))
        print(f"{args.export} holds the fine-tuned weights and class names: 'thomas-tune infer "
              f"--export {args.export} IMAGE' classifies with them")
    return 0


def cmd_infer(args) -> int:
    import numpy as np
    from ..data import IMAGE_EXTENSIONS, to_model_input
    session = open_session(args, args.checkpoint, mode="infer")
    if args.data:
        data = _data(args, session.model)
        acc = session.evaluate(data.x, data.y)
        print(f"accuracy on {data.source}: {100 * acc:.1f}% of {len(data.y)} images")
        return 0
    from PIL import Image
    paths = [p for p in args.images if p.lower().endswith(IMAGE_EXTENSIONS)]
    if not paths:
        print("error: give image files or --data", file=sys.stderr)
        return 2
    images = []
    for p in paths:
        try:
            with Image.open(p) as im:
                images.append(np.asarray(im.convert("RGB"), dtype="float32"))
        except OSError as err:  # missing, unreadable, or not an image (UnidentifiedImageError)
            raise ValueError(f"image {p!r} cannot be read ({err}); give image files "
                             "(PNG, JPEG, ...) or --data") from err
    logits = session.predict(to_model_input(images, session.model.resolution))
    names = session.classes or [str(i) for i in range(session.model.num_classes)]
    for p, row in zip(paths, logits):
        e = np.exp(row - row.max())
        k = int(np.argmax(row))
        print(f"{p}: {names[k]} ({100 * e[k] / e.sum():.1f}%)")
    return 0


def add_train_infer(sub) -> None:
    for name, fn, hlp in (("train", cmd_train, "fine-tune on data: an export, or a model "
                                                "compiled for --trainable / --from-scratch"),
                          ("infer", cmd_infer, "classify images with an exported module")):
        s = sub.add_parser(name, help=hlp)
        if name == "train":
            s.add_argument("--export", help="export folder (default: compile the model given "
                           "by the model options into --out first)")
            add_model_args(s)
            add_target_arg(s)
            s.add_argument("--log", help="tuning log for that compile (default: none)")
            s.add_argument("--out", help="folder for that compile (default: a temp folder); "
                           "after training it holds the fine-tuned weights and class names")
            s.add_argument("--cache-features", action="store_true",
                           help="with --trainable last:K: compute the frozen layers' output "
                                "once per training image (kept in this process's memory) and "
                                "train the last K layers on it; the same steps as without, "
                                "for data without random augmentation (an --export must be "
                                "made with --cache-features)")
        else:
            s.add_argument("--export", required=True, help="export folder")
            s.add_argument("--checkpoint", help="weights (and class names) to classify with, "
                           "e.g. train --save's: same model as the export, no recompile")
        add_remote_args(s)
        s.add_argument("--data", default=None if name == "infer" else "mnist5k",
                       help="image folder (one sub-folder per class) or a shipped data set: "
                            "mnist5k, digits")
        s.add_argument("--limit", type=int, help="use at most N images (stratified)")
        s.add_argument("--seed", type=int, default=0)
        if name == "train":
            s.add_argument("--steps", type=int, default=200)
            s.add_argument("--test-fraction", type=float, default=0.2)
            s.add_argument("--save", help="write the fine-tuned checkpoint here")
            s.add_argument("--quiet", action="store_true", help="no progress bar")
        else:
            s.add_argument("images", nargs="*", help="image files")
        s.set_defaults(fn=fn)
