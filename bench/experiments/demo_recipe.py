"""Which fine-tuning recipe makes the demo's held-out accuracy robust to rounding.

The demo fine-tunes the shipped MobileNetV2 (w0.35, 64x64, pretrained on MNIST digits 0-4) with a
fresh 5-class head on digits 5-9: every layer trainable, batch 8, momentum SGD 0.9 at lr 0.01,
150 steps, BatchNorm in training form, then held-out accuracy with the running statistics. Runs
whose kernels only sum in another order end anywhere between 55% and 93%: the recipe is chaotic.

This script trains each recipe in PyTorch float32 (``thomas_tune.reference.torch_module``, one
CPU thread, deterministic) R times with the same head, batches and dropout draws; run r > 0
multiplies every initial parameter by ``1 + eps * N(0, 1)`` (numpy seed r; run 0 unperturbed),
a stand-in for the device's rounding differences that chaotic training amplifies alike. Per
recipe it reports each run's held-out accuracy, their min/max/mean, the mean training loss over
the last 20 steps (mean over runs) and the wall seconds.

    python bench/experiments/demo_recipe.py [--runs 8] [--eps 1e-6] [--only baseline,cosine]
        [--recipe "name:lr=0.01,steps=150,schedule=cosine,precise_bn=20,frozen_bn=1"]

A recipe's fields: ``lr``, ``steps``, ``schedule`` (constant | cosine | linear: per-step decay
to 0 over ``steps``), ``precise_bn`` (0, or the number of training batches whose BatchNorm
statistics, averaged cumulatively after a reset, replace the running ones before evaluation),
``frozen_bn`` (BatchNorm in inference form while training; its affine parameters still train).
Writes ``bench/results/demo_recipe.json`` (``--out``): one sweep per ``--eps``/``--runs``,
each recipe -> accuracies, min/max/mean, last-20-steps loss, seconds. ``--table`` prints the
file's tables without training.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from dataclasses import asdict, dataclass, fields

import numpy as np

ROOT = os.path.abspath(os.path.join(__file__, "../../.."))
BATCH = 8
MOMENTUM = 0.9
LOSS_WINDOW = 20


@dataclass
class Recipe:
    """One fine-tuning recipe (module docstring); the rest is the demo's."""

    name: str
    lr: float = 0.01
    steps: int = 150
    schedule: str = "constant"
    precise_bn: int = 0
    frozen_bn: bool = False

    def lr_at(self, step: int) -> float:
        """Learning rate of step ``step`` (0-based)."""
        t = step / self.steps
        if self.schedule == "constant":
            return self.lr
        if self.schedule == "cosine":
            return self.lr * 0.5 * (1.0 + math.cos(math.pi * t))
        if self.schedule == "linear":
            return self.lr * (1.0 - t)
        raise ValueError(f"unknown schedule {self.schedule!r} (constant, cosine, linear)")


RECIPES = [
    Recipe("baseline"),
    Recipe("lr0.005", lr=0.005),
    Recipe("lr0.003", lr=0.003),
    Recipe("lr0.005-300steps", lr=0.005, steps=300),
    Recipe("cosine", schedule="cosine"),
    Recipe("linear", schedule="linear"),
    Recipe("precise-bn", precise_bn=20),
    Recipe("frozen-bn", frozen_bn=True),
    Recipe("cosine+precise-bn", schedule="cosine", precise_bn=20),
    Recipe("linear+precise-bn", schedule="linear", precise_bn=20),
]


def parse_recipe(text: str) -> Recipe:
    """``name:key=value,...`` (keys: the fields of :class:`Recipe`) -> Recipe."""
    name, _, rest = text.partition(":")
    types = {f.name: f.type for f in fields(Recipe)}
    kw = {}
    for item in filter(None, rest.split(",")):
        key, _, value = item.partition("=")
        if key not in types or key == "name":
            raise SystemExit(f"--recipe {text!r}: unknown field {key!r}")
        t = types[key]
        kw[key] = (value.lower() in ("1", "true", "yes") if t in (bool, "bool") else
                   int(value) if t in (int, "int") else
                   float(value) if t in (float, "float") else value)
    return Recipe(name, **kw)


def perturbed(tensors: dict, names: list[str], eps: float, run: int) -> dict:
    """``tensors`` with every tensor in ``names`` multiplied by ``1 + eps * N(0, 1)`` (numpy
    seed ``run``), in float32; run 0 (or eps 0) unchanged."""
    if run == 0 or eps == 0:
        return dict(tensors)
    rng = np.random.default_rng(run)
    out = dict(tensors)
    for n in names:
        w = np.asarray(tensors[n], "float64")
        out[n] = (w * (1.0 + eps * rng.standard_normal(w.shape))).astype("float32")
    return out


def accuracy(net, test, chunk: int = 200) -> float:
    """Held-out accuracy of ``net`` in eval mode (BatchNorm running statistics)."""
    import torch
    net.eval()
    with torch.no_grad():
        pred = np.concatenate([net(torch.from_numpy(test.x[i:i + chunk])).argmax(1).numpy()
                               for i in range(0, len(test.y), chunk)])
    return float(np.mean(pred == test.y))


def recalibrate_bn(net, model, train, batches: int, seed: int) -> None:
    """Precise BatchNorm: replace every running statistic by the plain average of the batch
    statistics (mean, unbiased variance: what ``BatchNorm2d`` with ``momentum=None`` keeps
    after a reset) of ``batches`` training batches (batch 8, own shuffle ``seed``), forwarded
    in training form under ``no_grad``; the weights do not change."""
    import torch
    from thomas_tune.reference import TorchGraph

    sums: dict[str, torch.Tensor] = {}

    class BatchStats(TorchGraph):
        def batch_norm(self, name, x, eps=1e-5, momentum=0.1, act=None):
            dims = [0, 2, 3]
            for key, v in (("running_mean", x.mean(dims)),
                           ("running_var", x.var(dims, unbiased=True))):
                k = f"{name}.{key}"
                sums[k] = sums[k] + v if k in sums else v.clone()
            return super().batch_norm(name, x, eps, momentum, act)

    params = dict(net.named_parameters())
    bufs = dict(net.named_buffers())
    it = train.batches(BATCH, np.random.default_rng(seed))
    with torch.no_grad():
        for _ in range(batches):
            x, _ = next(it)
            model.forward(BatchStats(params, dict(bufs), {}, True), torch.from_numpy(x))
        for k, v in sums.items():
            bufs[k].copy_(v / batches)
    assert sums and set(sums) == {k for k in bufs if k.endswith(("running_mean", "running_var"))}


def train_run(recipe: Recipe, model, tensors, train, test, run: int, eps: float) -> dict:
    """One fine-tune of ``recipe`` from ``tensors`` perturbed for ``run``: the demo's batches
    (seed 0), the same dropout draws in every run. Returns the held-out accuracy (``acc``;
    for a precise-BN recipe also ``acc_running_stats``, before the recalibration) and the
    mean loss of the last 20 steps."""
    import torch
    from thomas_tune.models import spec
    from thomas_tune.reference import torch_module
    pnames = [p.name for p in spec(model).params]
    torch.manual_seed(0)  # dropout draws: the same in every run
    net = torch_module(model, perturbed(tensors, pnames, eps, run), dtype="float32")
    net.frozen_bn = recipe.frozen_bn
    net.train()
    opt = torch.optim.SGD(net.parameters(), lr=recipe.lr, momentum=MOMENTUM)
    batches = train.batches(BATCH, np.random.default_rng(0))
    losses = []
    for step in range(recipe.steps):
        for g in opt.param_groups:
            g["lr"] = recipe.lr_at(step)
        x, y = next(batches)
        loss = torch.nn.functional.cross_entropy(net(torch.from_numpy(x)), torch.from_numpy(y))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    out = {"loss_last": float(np.mean(losses[-LOSS_WINDOW:])),
           "finite": bool(np.all(np.isfinite(losses)))}
    if recipe.precise_bn:
        out["acc_running_stats"] = accuracy(net, test)
        recalibrate_bn(net, model, train, recipe.precise_bn, seed=1)
    out["acc"] = accuracy(net, test)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=8, help="runs per recipe (run 0 unperturbed)")
    ap.add_argument("--eps", type=float, default=1e-6, help="relative weight perturbation")
    ap.add_argument("--only", help="comma-separated names of the built-in recipes to run")
    ap.add_argument("--recipe", action="append", default=[],
                    help="an extra recipe, name:key=value,... (module docstring); repeatable")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "demo_recipe.json"))
    ap.add_argument("--table", action="store_true", help="print --out's tables and exit")
    args = ap.parse_args()
    if args.table:
        with open(args.out) as f:
            for key, sw in json.load(f)["sweeps"].items():
                print(f"\n{key}")
                print_table(sw["recipes"])
        return

    import torch
    torch.set_num_threads(args.threads)
    from thomas_tune.demo import FINE_TUNE_DIGITS, digits, pretrained_path
    from thomas_tune.models import load_checkpoint, replace_head

    recipes = RECIPES
    if args.only is not None:
        keep = [n for n in args.only.split(",") if n]
        unknown = set(keep) - {r.name for r in RECIPES}
        if unknown:
            raise SystemExit(f"--only: unknown recipe(s) {sorted(unknown)}")
        recipes = [r for r in RECIPES if r.name in keep]
    recipes = recipes + [parse_recipe(t) for t in args.recipe]

    model, tensors, _ = load_checkpoint(pretrained_path())
    model, tensors = replace_head(model, tensors, len(FINE_TUNE_DIGITS), seed=0)
    train, test = digits("mnist5k", FINE_TUNE_DIGITS, model.resolution, 2000, 0)
    print(f"{len(train.y)} training / {len(test.y)} held-out images; {args.runs} runs per "
          f"recipe, eps {args.eps:g}", flush=True)

    config = {"batch": BATCH, "momentum": MOMENTUM, "runs": args.runs, "eps": args.eps,
              "threads": args.threads, "train_images": len(train.y),
              "held_out_images": len(test.y), "loss_window": LOSS_WINDOW}
    # one sweep per perturbation size and run count; other sweeps already in the file, and
    # other recipes of this one, are kept
    results = {"sweeps": {}}
    if os.path.exists(args.out):
        with open(args.out) as f:
            results = json.load(f)
    sweep = results["sweeps"].setdefault(f"eps={args.eps:g},runs={args.runs}",
                                         {"config": config, "recipes": {}})
    for recipe in recipes:
        t0 = time.perf_counter()
        runs = []
        for r in range(args.runs):
            runs.append(train_run(recipe, model, tensors, train, test, r, args.eps))
            print(f"  {recipe.name} run {r}: {100 * runs[-1]['acc']:.1f}%"
                  + (f" (running stats {100 * runs[-1]['acc_running_stats']:.1f}%)"
                     if "acc_running_stats" in runs[-1] else "")
                  + f", loss {runs[-1]['loss_last']:.3f}", flush=True)
        accs = [u["acc"] for u in runs]
        row = {"recipe": asdict(recipe), "acc": accs, "min": min(accs), "max": max(accs),
               "mean": float(np.mean(accs)),
               "loss_last": float(np.mean([u["loss_last"] for u in runs])),
               "losses_last": [u["loss_last"] for u in runs],
               "seconds": time.perf_counter() - t0}
        if recipe.precise_bn:
            row["acc_running_stats"] = [u["acc_running_stats"] for u in runs]
        sweep["recipes"][recipe.name] = row
        os.makedirs(os.path.dirname(args.out), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    print_table(sweep["recipes"])


def print_table(rows: dict) -> None:
    print(f"\n{'recipe':<28} {'min':>5} {'max':>5} {'mean':>5} {'loss':>6} {'s':>5}  accuracies %")
    for name, r in rows.items():
        print(f"{name:<28} {100 * r['min']:5.1f} {100 * r['max']:5.1f} {100 * r['mean']:5.1f} "
              f"{r['loss_last']:6.3f} {r['seconds']:5.0f}  "
              + " ".join(f"{100 * a:.1f}" for a in r["acc"]))


if __name__ == "__main__":
    main()
