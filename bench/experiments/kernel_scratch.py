"""Global scratch buffers the tuned kernels of a training step allocate inside themselves.

    python bench/experiments/kernel_scratch.py --log LOG [--model mobilenet_v2 --width 1.0
        --resolution 224 --classes 1000 --batch 32 --trainable all
        --target targets/h100_opencl.json] [--top 10]

The training step's kernels as an export fuses them, each given its tuning record from LOG
(MetaSchedule's ``ApplyDatabase``, as ``compile._pipeline`` does); for each kernel a record
changed, the buffers its blocks allocate in global memory (an ``rfactor`` of a reduction, a
padded copy of an input), which the runtime takes from its workspace pool when the kernel runs.
The step's memory estimate (``memory_plan.compiled_step_memory``) is made before schedules and
does not count them. Prints the kernels with such buffers, largest first, and their total.
"""

from __future__ import annotations

import argparse

import numpy as np


def scratch_buffers(func) -> list[tuple[str, tuple[int, ...], str]]:
    """(name, shape, dtype) of each global buffer the blocks of PrimFunc ``func`` allocate."""
    import tvm
    found = []

    def visit(block):
        found.extend((b.name, tuple(int(x) for x in b.shape), str(b.dtype))
                     for b in block.alloc_buffers if b.scope() == "global")
    sch = tvm.s_tir.Schedule(tvm.IRModule({"main": func}))
    todo = [sch.get_sblock("root")]
    while todo:
        rv = todo.pop()
        visit(sch.get(rv))
        todo.extend(sch.get_child_blocks(rv))
    return found


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
    import tvm
    import tvm_ffi
    from tvm import relax

    from thomas_tune.compiler.compile import tuned_database
    from thomas_tune.logs import TuningLog
    from thomas_tune.models import build
    from thomas_tune.target import parse_target
    from thomas_tune.tasks import fuse
    from thomas_tune.training_graph import graph as G
    from thomas_tune.training_graph.library_module import training_library_module
    model = build(a.model, num_classes=a.classes, resolution=a.resolution, width=a.width)
    target = parse_target(a.target)
    mod, _ = training_library_module(G.training_module(model, a.batch, a.trainable, None))
    database, _ = tuned_database(TuningLog(a.log), target)
    with tvm.transform.PassContext(opt_level=3):
        mod = fuse(mod, None)
        before = dict(mod.functions)
        with target, database:
            mod = relax.transform.MetaScheduleApplyDatabase(enable_warning=False)(mod)
    rows = []
    for gv, func in mod.functions.items():
        if not isinstance(func, tvm.tirx.PrimFunc) or tvm_ffi.structural_equal(
                func, before.get(gv)):
            continue  # a kernel without a record: its default schedule allocates no scratch
        bufs = scratch_buffers(func)
        if bufs:
            size = sum(int(np.prod(s)) * tvm.runtime.DataType(d).bits // 8 for _, s, d in bufs)
            rows.append((size, gv.name_hint, bufs))
    rows.sort(key=lambda r: -r[0])
    for size, name, bufs in rows[:a.top]:
        print(f"{size:>12,} B  {name}: " + ", ".join(f"{n}{list(s)}" for n, s, _ in bufs))
    print(f"{len(rows)} tuned kernels with global scratch, {sum(r[0] for r in rows):,} B in all, "
          f"the largest {max((r[0] for r in rows), default=0):,} B")


if __name__ == "__main__":
    main()
