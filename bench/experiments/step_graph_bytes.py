"""The bytes a training step's kernels are given, by precision, as the graph states them.

For each precision, the fused kernels of one training step of a full-size network at batch 32
(every layer trainable, no tuning log: the kernels the graph has before any schedule) with
the bytes of their arguments summed over their calls
(:func:`thomas_tune.benchmark.kernels.step_kernels`): the graph's share of what the sidecar's
``launch_arg_bytes`` counts on a device, where a build's schedules may add kernels of their own
(two-level sums, scratch buffers). Prints the totals and the 45 kernels that are given the
most bytes.

    python bench/experiments/step_graph_bytes.py alexnet float32 mixed16
"""

from __future__ import annotations

import sys

from thomas_tune.benchmark.kernels import step_kernels
from thomas_tune.compiler.export import _graph_modules
from thomas_tune.models import build

name = sys.argv[1] if len(sys.argv) > 1 else "alexnet"
model = build(name, num_classes=1000)
for precision in sys.argv[2:] or ["float32", "mixed16"]:
    modules = _graph_modules(model, 32, 1, "all", None, False, precision=precision)
    kernels = sorted(step_kernels(modules.train), key=lambda k: -k.bytes * k.calls)
    print(f"== {precision}: {len(kernels)} kernels, {sum(k.calls for k in kernels)} calls, "
          f"{sum(k.bytes * k.calls for k in kernels) / 1e6:.1f} MB")
    for k in kernels[:45]:
        shapes = " ".join(f"{dtype}{list(shape)}" for shape, dtype in k.args)
        print(f"{k.bytes * k.calls / 1e6:9.1f} MB x{k.calls} {k.name[:44]:44} {shapes[:120]}")
