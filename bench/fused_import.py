"""The ways to fine-tune a BatchNorm-fused ONNX import, measured over fine-tuning recipes.

    python bench/fused_import.py [--recipe 0.005x300 --recipe 0.01x150] [--seeds 3]
                                 [--width 0.5] [--work DIR] [--out bench/results]
                                 [--paths P,...] [--trainable T,...] [--precision mixed16]
                                 [--name fused_import]

The network is ``bench/four_levels.py --imported``'s: a MobileNetV2 (``--width``, 64x64)
pretrained in PyTorch on digits 0-4 of mnist5k, exported with ``torch.onnx.export`` and
BatchNorm fused into the convolutions (the exporter's default), imported with
:func:`~thomas_tune.models.onnx_import.import_onnx`. It is fine-tuned on digits 5-9 with a new
5-class head (batch 8, momentum SGD 0.9 at each ``--recipe``'s learning rate and steps; the
untuned llvm build on every core) by each path a user can take:

* ``calibrated 0-4``: ``import-onnx --calibrate`` on 512 images of the pretraining digits,
  BatchNorm in training form;
* ``calibrated 5-9``: the same calibration on 512 images of the fine-tuning digits (the images
  a user has);
* ``plain``: the import as it is (identity BatchNorms), BatchNorm in training form;
* ``frozen-bn``: the import as it is, ``--trainable ...,frozen-bn`` (every BatchNorm in
  inference form);
* ``PyTorch``: PyTorch float32 fine-tuning the original network (BatchNorm not fused) with the
  same recipe, head, batches, dropout masks and BatchNorm forms as ``plain``: the reference.

each for ``--trainable all`` and ``last:2`` and ``--seeds`` seeds (``--paths`` and
``--trainable`` pick fewer). ``--precision`` (repeatable) runs the project's paths at each
precision (``export --precision``: ``mixed16`` stores the step's activations as float16), each
from the same weights on the same batches. Every run is judged by
:func:`thomas_tune.train.divergence` (the test ``train`` warns by): a run that diverged is
marked in the table. Writes ``NAME.json`` (``--name``, default ``fused_import``; every run:
accuracy before and after, losses, signs of divergence) and ``NAME.md`` into ``--out``, the
JSON after every run. ``--work`` keeps the pretrained network, the ONNX file and the exports
for a rerun.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import tempfile
import time
import warnings

import numpy as np

import four_levels as F

PATHS = ("calibrated 0-4", "calibrated 5-9", "plain", "frozen-bn", "PyTorch")
TRAINABLE = ("all", "last:2")
CALIBRATION_IMAGES = 512


def recipe(text: str) -> tuple[float, int]:
    """``"LRxSTEPS"`` (e.g. ``0.005x300``) -> (learning rate, steps); ArgumentTypeError
    otherwise."""
    m = re.fullmatch(r"([0-9.eE+-]+)x([0-9]+)", text)
    try:
        lr, steps = float(m.group(1)), int(m.group(2))
    except (AttributeError, ValueError):
        lr = steps = None
    if lr is None or lr <= 0 or steps <= 0:
        raise argparse.ArgumentTypeError(f"recipe {text!r}: give LRxSTEPS, e.g. 0.005x300")
    return lr, steps


def _pretrained(work, width, seed, pre_train, pretrain_steps):
    """The network pretrained in PyTorch on digits 0-4 and its fused ONNX file (made once
    per ``work`` folder): (model, original tensors, ONNX path)."""
    import torch
    from thomas_tune.models import build
    from thomas_tune.reference import torch_module, torch_pretrain
    model = build("mobilenet_v2", num_classes=5, resolution=F.CONFIG["resolution"], width=width)
    prefix = os.path.join(work, f"mobilenet_v2-w{width:g}-r{F.CONFIG['resolution']}")
    pre_path, onnx_path = f"{prefix}-torch-mnist0to4.npz", f"{prefix}-fused.onnx"
    if not os.path.exists(pre_path):
        print(f"pretraining in PyTorch on digits 0-4 ({pretrain_steps} steps)", flush=True)
        np.savez(pre_path, **torch_pretrain(model, pre_train, pretrain_steps, seed))
    original = dict(np.load(pre_path))
    if not os.path.exists(onnx_path):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch.onnx.export(torch_module(model, original),
                              (torch.randn(1, *model.input_shape(1)[1:]),), onnx_path,
                              dynamo=True, optimize=True, verbose=False)
    return model, original, onnx_path


def _export(work, model, tensors, trainable, lr, precision="float32"):
    """The untuned llvm export of ``trainable`` at learning rate ``lr`` and ``precision``
    (made once per ``work`` folder): its folder."""
    from thomas_tune.compiler.export import export
    from thomas_tune.training_graph.optimizers import OptimizerConfig
    from thomas_tune.target import parse_target
    folder = os.path.join(work, f"export-{trainable.replace(':', '').replace(',', '-')}-lr{lr:g}"
                          + ("" if precision == "float32" else f"-{precision}"))
    if not os.path.exists(os.path.join(folder, "manifest.json")):
        print(f"export {trainable}, lr {lr:g}, {precision}", flush=True)
        export(folder, model, tensors, parse_target("llvm"), batch=F.BATCH, trainable=trainable,
               optimizer=OptimizerConfig(lr=lr, momentum=F.OPT["momentum"]),
               progress=lambda m: None, precision=precision)
    return folder


def _judged(report, classes, held_out) -> dict:
    from thomas_tune.train import divergence
    return {"acc_before": report.acc_before, "acc_after": report.acc_after,
            "loss_first": report.losses[0], "loss_last": report.losses[-1],
            "losses": report.losses, "diverged": divergence(report, classes, held_out)}


def _ours(export_dir, tensors, train, test, steps, seed) -> dict:
    from thomas_tune.runtime import Session
    from thomas_tune.train import fine_tune
    with Session(export_dir, seed=seed) as s:
        s.load_tensors(tensors)
        r = fine_tune(s, train, test, steps, seed=seed, show_progress=False)
    return _judged(r, len(test.classes), len(test.y))


def _pytorch(model, tensors, trainable, train, test, steps, seed, lr) -> dict:
    from thomas_tune.training_graph.graph import (frozen_batchnorms, parse_trainable,
                                                  select_trainable)
    from thomas_tune.train import TrainReport
    names = select_trainable(model, trainable)
    frozen = frozen_batchnorms(model, names, parse_trainable(trainable)[1])
    r = F._torch_run(model, tensors, names, train, test, steps, seed, lr=lr, frozen_bn=frozen)
    report = TrainReport(r["acc_before"], r["acc_after"], steps, losses=r["losses"])
    return _judged(report, len(test.classes), len(test.y))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--recipe", type=recipe, action="append",
                    help="learning rate and steps, LRxSTEPS; repeat for several (default "
                         "0.005x300 and 0.01x150)")
    ap.add_argument("--seeds", type=int, default=3, help="fine-tuning seeds (default 3)")
    ap.add_argument("--width", type=float, default=0.5, help="MobileNetV2 width (default 0.5)")
    ap.add_argument("--pretrain-steps", type=int, default=400)
    ap.add_argument("--seed", type=int, default=0,
                    help="seed of the data split, the pretraining and the calibration images")
    ap.add_argument("--work", help="folder kept between runs (default: a temp folder)")
    ap.add_argument("--out", default=os.path.join(F.ROOT, "bench", "results"))
    ap.add_argument("--paths", type=lambda t: t.split(","), default=list(PATHS),
                    help="comma-separated paths to run (default all: " + ", ".join(PATHS) + ")")
    ap.add_argument("--trainable", type=lambda t: t.split(","), default=list(TRAINABLE),
                    help="comma-separated trainable sets (default all,last:2)")
    ap.add_argument("--precision", action="append", choices=["float32", "mixed16"],
                    help="the project's step precision; repeat for several (default float32)")
    ap.add_argument("--name", default="fused_import", help="name of the JSON and table files")
    args = ap.parse_args()
    for path in args.paths:
        if path not in PATHS:
            ap.error(f"--paths: unknown path {path!r}; give some of {', '.join(PATHS)}")
    precisions = args.precision or ["float32"]
    recipes = args.recipe or [(0.005, 300), (0.01, 150)]
    from thomas_tune.models import replace_head
    from thomas_tune.models.calibration import calibrate_batchnorms
    from thomas_tune.models.onnx_import import import_onnx

    t_start = time.perf_counter()
    work = args.work or tempfile.mkdtemp(prefix="fused-import-")
    os.makedirs(work, exist_ok=True)
    os.makedirs(args.out, exist_ok=True)
    pre_train, pre_test = F._data([0, 1, 2, 3, 4], F.LIMIT, args.seed)
    ft_train, ft_test = F._data([5, 6, 7, 8, 9], F.LIMIT, args.seed)
    model, original, onnx_path = _pretrained(work, args.width, args.seed, pre_train,
                                             args.pretrain_steps)
    _, fused, report = import_onnx(onnx_path, "mobilenet_v2", width=args.width)
    pick = np.random.default_rng(args.seed)
    starts = {"plain": fused, "frozen-bn": fused, "PyTorch": original}
    for path, pool in (("calibrated 0-4", pre_train.x), ("calibrated 5-9", ft_train.x)):
        images = pool[pick.permutation(len(pool))[:CALIBRATION_IMAGES]]
        starts[path] = calibrate_batchnorms(model, fused, images, report.fused_batchnorms)[0]
    results = {"config": {"arch": "mobilenet_v2", "width": args.width,
                          "resolution": F.CONFIG["resolution"], "batch": F.BATCH,
                          "optimizer": "momentum_sgd", "momentum": F.OPT["momentum"],
                          "recipes": [{"lr": lr, "steps": n} for lr, n in recipes],
                          "seeds": args.seeds, "pretrain_steps": args.pretrain_steps,
                          "fused_batchnorms": len(report.fused_batchnorms),
                          "calibration_images": CALIBRATION_IMAGES,
                          "train_images": len(ft_train.y), "held_out_images": len(ft_test.y),
                          "paths": args.paths, "trainable": args.trainable,
                          "precisions": precisions},
               "pytorch_accuracy_digits_0to4": F._torch_run(
                   model, original, [], pre_train, pre_test, 0, args.seed)["acc_before"],
               "runs": []}
    for seed in range(args.seed, args.seed + args.seeds):  # a whole pass per seed
        for lr, steps in recipes:
            for trainable, path, precision in _runs(args.trainable, args.paths, precisions):
                    t0 = time.perf_counter()
                    start = starts[path]
                    _, init = replace_head(model, start, 5, seed=seed + 1)
                    if path == "PyTorch":
                        r = _pytorch(model, init, trainable, ft_train, ft_test, steps, seed, lr)
                    else:
                        tr = f"{trainable},frozen-bn" if path == "frozen-bn" else trainable
                        r = _ours(_export(work, model, fused, tr, lr, precision), init, ft_train,
                                  ft_test, steps, seed)
                    results["runs"].append({"lr": lr, "steps": steps, "trainable": trainable,
                                            "path": path, "seed": seed, "precision": precision,
                                            "wall_s": time.perf_counter() - t0, **r})
                    print(f"lr {lr:g} x {steps}, {trainable}, {path} ({precision}), seed {seed}: "
                          f"{100 * r['acc_before']:.1f}% -> {100 * r['acc_after']:.1f}% (loss "
                          f"{r['loss_first']:.3f} -> {r['loss_last']:.3f})"
                          + (f" DIVERGED: {'; '.join(r['diverged'])}" if r["diverged"] else ""),
                          flush=True)
                    results["wall_s"] = time.perf_counter() - t_start
                    with open(os.path.join(args.out, f"{args.name}.json"), "w") as f:
                        json.dump(results, f, indent=1)
    write_table(results, args.out, args.name)


def _runs(trainables, paths, precisions):
    """(trainable set, path, precision) of each run of one seed and recipe; PyTorch's path
    once per trainable set (it has no precision of the project's)."""
    for trainable in trainables:
        for path in paths:
            for precision in (["float32"] if path == "PyTorch" else precisions):
                yield trainable, path, precision


def table(results) -> list[str]:
    """The markdown table of a ``fused_import.json``: per recipe and trainable set, the
    mean held-out accuracy of each path (at each precision run), its seeds, and how many runs
    diverged."""
    cfg = results["config"]
    trainables = cfg.get("trainable", TRAINABLE)
    columns = list(dict.fromkeys((r["path"], r.get("precision", "float32"))
                                 for r in results["runs"]))
    columns.sort(key=lambda c: (PATHS.index(c[0]), c[1] != "float32", c[1]))
    names = [p if prec == "float32" else f"{p} ({prec})" for p, prec in columns]
    lines = [f"MobileNetV2 width {cfg['width']:g}, {cfg['resolution']}x{cfg['resolution']}, "
             "pretrained in PyTorch on digits 0-4, exported with BatchNorm fused "
             f"({cfg['fused_batchnorms']} layers), fine-tuned on digits 5-9 with a new head: "
             f"batch {cfg['batch']}, momentum SGD {cfg['momentum']:g}; held-out accuracy "
             f"(%) on {cfg['held_out_images']} images, mean and seeds; 'diverged' counts the "
             "runs `train` would warn about (thomas_tune.train.divergence).", "",
             "| recipe | trainable | " + " | ".join(names) + " |",
             "|---|---|" + "---|" * len(names)]
    for rc in cfg["recipes"]:
        for trainable in trainables:
            cells = []
            for path, precision in columns:
                runs = [r for r in results["runs"] if r["lr"] == rc["lr"]
                        and r["steps"] == rc["steps"] and r["trainable"] == trainable
                        and r["path"] == path and r.get("precision", "float32") == precision]
                if not runs:
                    cells.append("not run")
                    continue
                acc = [100 * r["acc_after"] for r in runs]
                bad = sum(bool(r["diverged"]) for r in runs)
                cells.append(f"**{np.mean(acc):.1f}** ({' / '.join(f'{a:.1f}' for a in acc)})"
                             + (f", diverged {bad} of {len(runs)}" if bad else ""))
            lines.append(f"| lr {rc['lr']:g} x {rc['steps']} | {trainable} | "
                         + " | ".join(cells) + " |")
    lines += ["", "`frozen-bn` is the trainable set with `,frozen-bn`; `PyTorch` fine-tunes the "
              "original network (BatchNorm not fused); `(mixed16)`: the step stores its "
              "activations as float16.",
              f"Wall time: {results['wall_s'] / 60:.1f} min."]
    return lines


def write_table(results, out, name="fused_import") -> None:
    """Write ``NAME.md`` into ``out`` and print it."""
    lines = table(results)
    with open(os.path.join(out, f"{name}.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
