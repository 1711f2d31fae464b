"""How far rounding alone moves a fine-tune's accuracy: PyTorch fine-tuning the same pretrained
network with the same recipe, head, batches and dropout masks in float32 and in float64.

    python bench/experiments/rounding_spread.py --work DIR [--arch mobilenet_v2] [--seeds 3]

``DIR`` is the ``--work`` folder of ``python bench/four_levels.py --imported``, which holds the
PyTorch-pretrained network (``<tag>-torch-mnist0to4.npz``). The two runs of a seed differ only
in rounding; their accuracy gap is the floor under any comparison of two float32 fine-tunes
(thomas_tune against PyTorch) on these 150 steps.
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.abspath(os.path.join(__file__, "../../..")),
                                "bench"))
import four_levels as F  # noqa: E402


def main():
    args = F.experiment_args(__doc__.splitlines()[0])
    from thomas_tune.training_graph.graph import select_trainable
    from thomas_tune.models import replace_head
    model, width, prefix = F.imported_model(args.work, args.arch)
    original = dict(np.load(f"{prefix}-torch-mnist0to4.npz"))
    ft_train, ft_test = F._data([5, 6, 7, 8, 9], F.LIMIT, 0)
    rows = {}
    for trainable in ("last:2", "all"):
        for seed in range(args.seeds):
            _, t0 = replace_head(model, original, 5, seed=seed + 1)
            acc = {dt: F._torch_run(model, t0, select_trainable(model, trainable), ft_train,
                                    ft_test, args.steps, seed, dtype=dt)["acc_after"]
                   for dt in ("float32", "float64")}
            rows.setdefault(trainable, []).append(acc)
            print(f"{trainable} seed {seed}: float32 {100 * acc['float32']:.1f}%, float64 "
                  f"{100 * acc['float64']:.1f}%", flush=True)
        r = rows[trainable]
        print(f"{trainable} mean of {args.seeds}: float32 "
              f"{100 * np.mean([a['float32'] for a in r]):.1f}%, float64 "
              f"{100 * np.mean([a['float64'] for a in r]):.1f}%", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"arch": args.arch, "steps": args.steps, "runs": rows}, f, indent=1)


if __name__ == "__main__":
    main()
