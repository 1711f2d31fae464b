"""Fine-tuning accuracy of half-precision storage against float32, on the demo's recipe.

    python bench/precision_accuracy.py [--seeds 0,1,2] [--target opencl] [--steps 300]
        [--out bench/results/precision_accuracy.json]

The demo's recipe (``thomas_tune.demo``): the shipped MobileNetV2 0.35@64 pretrained on digits
0-4, a fresh 5-class head (drawn with the seed), fine-tuned on digits 5-9 of mnist5k (at most
2,000 images, 80/20 split by the seed), every layer, batch 8, momentum SGD at lr 0.005, 300
steps. One export per precision (``thomas-tune export --precision``; default schedules: the
libraries do not depend on the weights, so each seed loads its own head into the same export),
then, per seed, both precisions fine-tuned from the same weights on the same batches
(:func:`thomas_tune.train.fine_tune`), held-out accuracy before and after. Prints one line per
run and the mean accuracy of each precision; writes the JSON. ``mixed16-scaled`` in
``--precisions``: mixed16 with ``--loss-scale dynamic`` (activation gradients stored as float16
too, :mod:`thomas_tune.half_grads`); its runs record the steps skipped and the last scale.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--target", default="opencl", help="opencl (PoCL on a CPU) or llvm")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--lr", type=float, default=0.005)
    p.add_argument("--limit", type=int, default=2000)
    p.add_argument("--precisions", default="float32,mixed16")
    p.add_argument("--work", default=None, help="folder for the exports (default: a temp one)")
    p.add_argument("--out", default="bench/results/precision_accuracy.json")
    a = p.parse_args()
    from thomas_tune.demo import FINE_TUNE_DIGITS, digits, pretrained_path
    from thomas_tune.compiler.export import export
    from thomas_tune.training_graph.graph import OptimizerConfig
    from thomas_tune.models import load_checkpoint, replace_head
    from thomas_tune.loss_scale import LossScale
    from thomas_tune.runtime import Session
    from thomas_tune.target import parse_target
    from thomas_tune.train import fine_tune

    work = a.work or tempfile.mkdtemp(prefix="precision-accuracy-")
    base, base_tensors, _ = load_checkpoint(pretrained_path())
    model, tensors = replace_head(base, base_tensors, len(FINE_TUNE_DIGITS), seed=0)
    dirs = {}
    for precision in a.precisions.split(","):
        dirs[precision] = os.path.join(work, precision)
        if not os.path.exists(os.path.join(dirs[precision], "manifest.json")):
            t0 = time.perf_counter()
            scaled = precision == "mixed16-scaled"
            export(dirs[precision], model, tensors, parse_target(a.target), batch=8,
                   trainable="all", optimizer=OptimizerConfig(lr=a.lr),
                   precision="mixed16" if scaled else precision,
                   loss_scale=LossScale() if scaled else None, progress=lambda _m: None)
            print(f"export {precision}: {time.perf_counter() - t0:.0f} s", flush=True)
    runs = []
    for seed in (int(s) for s in a.seeds.split(",")):
        _, head = replace_head(base, base_tensors, len(FINE_TUNE_DIGITS), seed=seed)
        train, test = digits("mnist5k", FINE_TUNE_DIGITS, model.resolution, a.limit, seed)
        for precision, d in dirs.items():
            session = Session(d, seed=seed)
            session.load_tensors(head)
            t0 = time.perf_counter()
            r = fine_tune(session, train, test, a.steps, seed=seed, show_progress=False)
            runs.append({"seed": seed, "precision": precision, "acc_before": r.acc_before,
                         "acc_after": r.acc_after, "first_loss": float(r.losses[0]),
                         "last_loss": float(r.losses[-1]), "skipped_steps": r.skipped_steps,
                         "loss_scale": r.loss_scale,
                         "wall_s": round(time.perf_counter() - t0, 1)})
            print(f"seed {seed} {precision:8s} held-out {100 * r.acc_before:.1f}% -> "
                  f"{100 * r.acc_after:.1f}%", flush=True)
    means = {pr: sum(r["acc_after"] for r in runs if r["precision"] == pr)
             / sum(r["precision"] == pr for r in runs) for pr in dirs}
    for pr, m in means.items():
        print(f"{pr}: mean held-out accuracy after {100 * m:.2f}%")
    res = {"recipe": {"steps": a.steps, "lr": a.lr, "batch": 8, "trainable": "all",
                      "limit": a.limit, "target": a.target}, "runs": runs, "mean_after": means}
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
