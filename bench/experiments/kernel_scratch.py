"""Global scratch buffers the tuned kernels of a training step allocate inside themselves.

    python bench/experiments/kernel_scratch.py --log LOG [--model mobilenet_v2 --width 1.0
        --resolution 224 --classes 1000 --batch 32 --trainable all
        --target targets/h100_opencl.json] [--top 10]

The training step's kernels as an export fuses them, each given the record from LOG the export
applies (``compile.tuned_database``); for each kernel a record changed, the buffers its blocks
allocate in global memory (an ``rfactor`` of a reduction, a padded copy of an input), which the
runtime takes from its workspace pool when the kernel runs (``memory_plan.kernel_scratch``,
which the step's memory estimate counts when an export has a log). Prints the kernels with
such buffers, largest first, and their total.
"""

from __future__ import annotations

import argparse


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--log", required=True)
    p.add_argument("--model", default="mobilenet_v2")
    p.add_argument("--width", type=float, default=1.0)
    p.add_argument("--resolution", type=int, default=224)
    p.add_argument("--classes", type=int, default=1000)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--trainable", default="all")
    p.add_argument("--target", default="targets/h100_opencl.json")
    p.add_argument("--top", type=int, default=10)
    a = p.parse_args()
    from thomas_tune.compiler.compile import tuned_database
    from thomas_tune.logs import TuningLog
    from thomas_tune.memory_plan import kernel_scratch, lowered_training_module
    from thomas_tune.models import build
    from thomas_tune.target import parse_target
    model = build(a.model, num_classes=a.classes, resolution=a.resolution, width=a.width)
    target = parse_target(a.target)
    mod, _ = lowered_training_module(model, a.batch, a.trainable)
    scratch = kernel_scratch(mod, target, tuned_database(TuningLog(a.log), target)[0])
    rows = sorted(((sum(sizes), name, sizes) for name, sizes in scratch.items()), reverse=True)
    for size, name, sizes in rows[:a.top]:
        print(f"{size:>12,} B  {name}: buffers of " + ", ".join(f"{n:,}" for n in sizes) + " B")
    print(f"{len(rows)} tuned kernels with global scratch, {sum(r[0] for r in rows):,} B in all, "
          f"the largest {max((r[0] for r in rows), default=0):,} B")


if __name__ == "__main__":
    main()
