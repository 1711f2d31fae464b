"""The step check's mutant table, and the right builds' pass rate over fresh seeds.

    python3 bench/mutants.py table [--target llvm] [--out DIR]
    python3 bench/mutants.py seeds --model mobilenet_v2 --seeds 40 [--target opencl]
    python3 bench/mutants.py check EXPORT... [--first SEED]

``table``: for the tests' networks (MobileNetV2 0.35@32 and AlexNet 0.1@67, 5 classes, batch
8, every layer trainable), each mutant of ``tests/mutants.py`` (x1.01 and the wrong sign for
every kind of gradient, the data-dependent ones, the momentum update's) is built, exported
and checked with :func:`thomas_tune.export_check.check_export` at seed 0; one line per
mutant: whether the check failed it, the parameter (or update output) furthest over its bound,
its error and bound. The parameters' own
gradients are also mutated in the right build's outputs (``param_mutant``). ``seeds``: the
right build of ``--model`` checked on ``--seeds`` fresh seeds (MobileNetV2 0.35@64, AlexNet at
the tests' size); prints each seed's line and the count that passed. ``check``: each export
(made elsewhere, e.g. on a GPU machine) checked at seed ``--first``: its line, then every
parameter's error, bound and PyTorch float32's error.
"""

from __future__ import annotations

import argparse
import itertools
import os
import re
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

NETS = {"mobilenet_v2": dict(num_classes=5, resolution=32, width=0.35),
        "alexnet": dict(num_classes=5, resolution=67, width=0.1)}
SEED_NETS = {"mobilenet_v2": dict(num_classes=5, resolution=64, width=0.35),
             "alexnet": dict(num_classes=5, resolution=67, width=0.1)}


def build(arch, config, target, out, seed=11, mutant=None):
    """Export ``arch`` (every layer trainable, batch 8) under ``mutant`` (a context manager
    or None) to ``out``; returns ``out``."""
    import contextlib

    from thomas_tune.compiler.export import export
    from thomas_tune.models import build as build_model, init_params
    from thomas_tune.target import parse_target
    model = build_model(arch, **config)
    with mutant if mutant is not None else contextlib.nullcontext():
        export(out, model, init_params(model, seed=seed), parse_target(target), batch=8,
               trainable="all", progress=lambda *_: None)
    return out


def worst(check):
    """(name, error, bound) of the parameter with the largest error / bound."""
    name = max(check.errors, key=lambda n: check.errors[n] / check.bounds[n])
    return name, check.errors[name], check.bounds[name]


def row(label, check, say=print):
    name, err, bound = worst(check)
    update = getattr(check, "update", None)
    if update is not None and not update.ok and err <= bound:  # wrong in the update only
        name = update.failing[0]
        err, bound = update.errors[name], update.bounds[name]
        name += " (update, ulps)"
    loss = f"loss {check.loss_err:.1e}/{check.loss_bound:.1e}"
    say(f"| {label} | {'fails' if not check.ok else '**passes**'} | {name} | {err:.1e} | "
        f"{bound:.1e} | {loss} |")


#: the order the table builds mutants in (the most telling first: a run cut short still has
#: them): the ones the old check let pass, then each kind x1.01, then the wrong signs
ORDER = ["BatchNorm bias", "BatchNorm weight", "ReLU6 above 6 (no upper clip)",
         "loss, last class x1.1", "BatchNorm input above 1 x1.01", "conv data, sample 0 x1.01",
         "ReLU6 below 0 (no lower clip)", "ReLU", "max pool", "bias (conv, linear)",
         "depthwise weight", "depthwise data", "conv weight", "conv data", "BatchNorm input",
         "linear weight", "linear data", "loss", "dropout"]


def _mutants(arch):
    """(label, context manager) of ``arch``'s mutants in :data:`ORDER`, x1.01 before the wrong
    signs."""
    import mutants as M
    other = M.NEEDS_MOBILENET if arch == "alexnet" else M.NEEDS_ALEXNET
    names = [n for n in ORDER if n not in other]
    out = [(n if n in M.DEPENDENT_MUTANTS else f"{n} x1.01",
            M.DEPENDENT_MUTANTS[n]() if n in M.DEPENDENT_MUTANTS else M.DATA_MUTANTS[n](1.01))
           for n in names]
    return out + [(f"{n} wrong sign", M.DATA_MUTANTS[n](-1.0)) for n in names
                  if n in M.DATA_MUTANTS] + [(n, m()) for n, m in M.UPDATE_MUTANTS.items()]


def table(args):
    from thomas_tune.export_check import check_export
    from thomas_tune.step_check import compare_step
    print("| mutant | check | parameter (worst error / bound) | error | bound | loss |")
    print("|---|---|---|---|---|---|")
    rights = {}
    for arch in args.models:
        right = os.path.join(args.out, f"{arch}-right")
        if not args.mutants_only:  # the mutants' rows do not read the right build
            if not os.path.exists(os.path.join(right, "train.so")):
                build(arch, NETS[arch], args.target, right)
            row(f"{arch}: right build", check_export(right))
            _param_rows(arch, right, compare_step)
        rights[arch] = _mutants(arch)
    count = itertools.count()
    while any(rights.values()):  # the networks in turn
        for arch in args.models:
            if rights[arch]:
                label, mutant = rights[arch].pop(0)
                if f"{arch}: {label}" in args.skip or not re.search(args.match, label):
                    continue
                # a folder each: a library loaded once is not loaded again from its path
                out = build(arch, NETS[arch], args.target,
                            os.path.join(args.out, f"mutant{next(count)}"), mutant=mutant)
                row(f"{arch}: {label}", check_export(out, seed=0))
                sys.stdout.flush()


def _param_rows(arch, right, compare_step):
    """Each parameter's own gradient x1.01 and with the wrong sign in the right build's
    outputs: the number of parameters the check failed of those mutated, and the smallest
    error / bound among them."""
    import mutants as M
    from thomas_tune.step_check import export_step, reference_steps, following_step
    from thomas_tune.manifest import Manifest
    from thomas_tune.models import load_checkpoint
    m = Manifest.read(right)
    model, tensors, _ = load_checkpoint(os.path.join(right, "params.npz"))
    ref = reference_steps(model, tensors, m.trainable, m.batch, 0)
    ours = [export_step(right, x, y, masks=mk) for (x, y), mk in zip(ref["batches"], ref["masks"])]
    follow = [following_step(ref, i, o[1]) for i, o in enumerate(ours)]
    yard = ref["yardstick"]
    for factor in (1.01, -1.0):
        caught, least = 0, None
        for name in m.trainable:
            grads = [M.param_mutant(o[1], name, factor) for o in ours]
            c = compare_step([o[0] for o in ours], grads, [f.loss for f in follow],
                             [f.grads for f in follow], yard.errors, yard.loss_err, ref["sums"])
            caught += name in c.failing
            ratio = c.errors[name] / c.bounds[name]
            least = ratio if least is None else min(least, ratio)
        print(f"| {arch}: each parameter's gradient x{factor} ({len(m['trainable'])}) | "
              f"{caught} fail | smallest error / bound {least:.1f} | | | |")


def seeds(args):
    from thomas_tune.export_check import check_export
    out = os.path.join(args.out, f"{args.model}-{args.target}-seeds")
    if not os.path.exists(os.path.join(out, "train.so")):
        build(args.model, SEED_NETS[args.model], args.target, out)
    from thomas_tune.step_check import CHECK_BATCHES
    passed = 0
    # seed s checks the batches of s, s + 1, s + 2: seeds CHECK_BATCHES apart share none
    for s in range(args.first, args.first + CHECK_BATCHES * args.seeds, CHECK_BATCHES):
        c = check_export(out, seed=s)
        passed += c.ok
        print(f"seed {s}: flips {c.flips}: {c.line()}", flush=True)
    print(f"{args.model} on {args.target}: {passed} of {args.seeds} seeds pass")


def check(args):
    from thomas_tune.export_check import check_export
    bad = 0
    for e in args.exports:
        t0 = time.perf_counter()
        c = check_export(e, seed=args.first)
        bad += not c.ok
        print(f"{e} ({time.perf_counter() - t0:.0f} s, flips {c.flips}): {c.line()}")
        print(c.table(), flush=True)
    return 1 if bad else 0


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("what", choices=["table", "seeds", "check"])
    p.add_argument("exports", nargs="*", help="with check: export folders")
    p.add_argument("--target", default="llvm")
    p.add_argument("--model", default="mobilenet_v2", choices=list(SEED_NETS))
    p.add_argument("--seeds", type=int, default=40)
    p.add_argument("--first", type=int, default=1000, help="first seed")
    p.add_argument("--out", default="/tmp/thomas_tune_mutants")
    p.add_argument("--models", nargs="+", default=list(NETS), choices=list(NETS))
    p.add_argument("--skip", nargs="*", default=[],
                   help="table: rows already made ('ARCH: LABEL')")
    p.add_argument("--match", default="",
                   help="table: only the mutants whose label matches this regular expression")
    p.add_argument("--mutants-only", action="store_true",
                   help="table: leave out the right builds' rows and the parameter rows")
    args = p.parse_args()
    os.makedirs(args.out, exist_ok=True)
    return {"table": table, "seeds": seeds, "check": check}[args.what](args)


if __name__ == "__main__":
    sys.exit(main())
