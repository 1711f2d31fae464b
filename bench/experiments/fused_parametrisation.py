"""Whether fine-tuning every layer of a BatchNorm-fused import with frozen BatchNorm loses
accuracy because of the fused parametrisation itself: PyTorch fine-tunes the *imported fused*
tensors (identity BatchNorms, weights W' = s W) with its BatchNorms frozen, beside PyTorch
fine-tuning the original network the same way.

    python bench/experiments/fused_parametrisation.py --work DIR [--arch mobilenet_v2] [--seeds 3]

``DIR`` is the ``--work`` folder of ``python bench/four_levels.py --imported`` (the pretrained
network and its fused ONNX file). With frozen BatchNorm both compute the same function at the
first step; a step of size lr on W' moves W = W'/s by lr/s^2 per channel, so channels with
small s (large running variance) train with a much larger effective learning rate.
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
    from thomas_tune.models.onnx_import import import_onnx
    model, width, prefix = F.imported_model(args.work, args.arch)
    original = dict(np.load(f"{prefix}-torch-mnist0to4.npz"))
    _, fused, _ = import_onnx(f"{prefix}-fused.onnx", args.arch, width=width)
    ft_train, ft_test = F._data([5, 6, 7, 8, 9], F.LIMIT, 0)
    trainable = select_trainable(model, "all,frozen-bn")
    runs = []
    for seed in range(args.seeds):
        _, head_fused = replace_head(model, fused, 5, seed=seed + 1)
        head = {k: v for k, v in head_fused.items()
                if k not in fused or not np.array_equal(v, fused[k])}
        acc = {name: F._torch_run(model, t, trainable, ft_train, ft_test, args.steps, seed,
                                  frozen_bn=True)["acc_after"]
               for name, t in (("original", {**original, **head}), ("fused", head_fused))}
        runs.append(acc)
        print(f"all,frozen-bn seed {seed}: PyTorch on the original {100 * acc['original']:.1f}%,"
              f" on the fused import {100 * acc['fused']:.1f}%", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"arch": args.arch, "steps": args.steps, "runs": runs}, f, indent=1)


if __name__ == "__main__":
    main()
