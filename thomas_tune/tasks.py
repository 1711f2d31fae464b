"""Tasks: the tunable kernels (fused TIR functions) of the inference and the training graph.

A task is one workload (a fused PrimFunc, identified by its structural hash as MetaSchedule's
database does), with the number of times the graphs call it and its FLOPs per call
(``tvm.s_tir.analysis.estimate_tir_flops``: multiply-adds count 2).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import tvm
import tvm_ffi
from tvm import relax
from tvm.s_tir import meta_schedule as ms
from tvm.s_tir.analysis import estimate_tir_flops


def fuse(mod: tvm.IRModule) -> tvm.IRModule:
    """Legalize and fuse a Relax module: every fused PrimFunc is one kernel of the graph.

    A matmul by a transposed 2-D operand (a linear layer's ``x @ W^T``) becomes one kernel that
    reads ``W`` in place (``FuseTransposeMatmul``): otherwise each forward pass copies the
    transposed weight first, 302 MB of traffic per step for AlexNet's first linear layer.
    """
    seq = tvm.transform.Sequential([
        relax.transform.FuseTransposeMatmul(),
        relax.transform.LegalizeOps(),
        relax.transform.AnnotateTIROpPattern(),
        relax.transform.FoldConstant(),
        relax.transform.FuseOps(),
        relax.transform.FuseTIR(),
    ])
    with tvm.transform.PassContext(opt_level=3):
        return seq(mod)


@dataclass
class Task:
    """One workload: ``name``, the PrimFunc module, FLOPs per call, and calls per graph."""

    name: str
    mod: tvm.IRModule
    flops: float
    calls: dict[str, int] = field(default_factory=dict)
    extracted: object = None  # ms.ExtractedTask, for tuning

    @property
    def weight(self) -> int:
        return sum(self.calls.values())

    @property
    def total_flops(self) -> float:
        return self.flops * self.weight


def extract(graphs: dict[str, tvm.IRModule], target: tvm.target.Target) -> list[Task]:
    """Tasks of several Relax graphs (name -> unfused module), deduplicated by workload.

    Returns tasks sorted by total FLOPs (calls x FLOPs per call), largest first.
    """
    by_key: dict[int, Task] = {}
    for graph_name, mod in graphs.items():
        for et in ms.relax_integration.extract_tasks(fuse(mod), target):
            key = tvm_ffi.structural_hash(et.dispatched[0])
            task = by_key.get(key)
            if task is None:
                try:
                    flops = float(estimate_tir_flops(et.dispatched[0]))
                except Exception:  # some kernels (e.g. int64 index math) have no estimate
                    flops = 0.0
                task = by_key[key] = Task(et.task_name, et.dispatched[0], flops, extracted=et)
            task.calls[graph_name] = task.calls.get(graph_name, 0) + int(et.weight)
    return sorted(by_key.values(), key=lambda t: -t.total_flops)


def summary(tasks: list[Task], total: float | None = None) -> str:
    """A text table: task, FLOPs per call (MFLOP), calls per graph, share of ``total`` FLOPs
    (default: of the tasks listed)."""
    total = total or sum(t.total_flops for t in tasks) or 1.0
    graphs = sorted({g for t in tasks for g in t.calls})
    lines = [f"{'#':>3}  {'task':<48} {'MFLOP/call':>11} " + " ".join(f"{g:>9}" for g in graphs)
             + f" {'share':>6}"]
    for i, t in enumerate(tasks):
        lines.append(f"{i:>3}  {t.name[:48]:<48} {t.flops / 1e6:>11.3f} "
                     + " ".join(f"{t.calls.get(g, 0):>9}" for g in graphs)
                     + f" {100 * t.total_flops / total:>5.1f}%")
    counts = ", ".join(f"{g}: {sum(1 for t in tasks if g in t.calls)}" for g in graphs)
    lines.append(f"{len(tasks)} tasks ({counts}); {sum(t.total_flops for t in tasks) / 1e9:.3f} "
                 "GFLOP per call of all graphs")
    return "\n".join(lines)


def key(task: Task) -> str:
    """A stable key of a task's workload: the structural hash of its TIR module, in decimal
    (the ``workload`` of a ``thomas-tune bench`` kernel table in JSON, and of tuning records)."""
    return str(tvm_ffi.structural_hash(task.mod))


def matching(tasks: list[Task], pattern: re.Pattern) -> list[Task]:
    """The tasks whose name ``pattern`` finds (``re.search``) or whose workload :func:`key` it
    matches whole (``re.fullmatch``).

    A kernel's name depends on the module it was fused in: the tuner, which fuses the
    inference and training graphs one by one, calls AlexNet's second forward convolution
    ``fused_conv2d1_add2`` where a bench's export calls it ``fused_conv2d1_add17``. Its key is
    the same in both."""
    return [t for t in tasks if pattern.search(t.name) or pattern.fullmatch(key(t))]


def select(tasks: list[Task], top: int | None = None, flops_share: float | None = None,
           skip_empty: bool = True) -> list[Task]:
    """The tasks worth tuning: the ``top`` largest by total FLOPs, or the fewest largest that
    cover ``flops_share`` (0..1] of all FLOPs. Zero-FLOP tasks (reshapes, copies) are left to
    default schedules when ``skip_empty``."""
    ranked = [t for t in tasks if t.total_flops > 0 or not skip_empty]
    if flops_share is not None:
        if not 0 < flops_share <= 1:
            raise ValueError(f"--flops-share must be in (0, 1], got {flops_share}")
        total, acc, out = sum(t.total_flops for t in ranked), 0.0, []
        for t in ranked:
            if acc >= flops_share * total:
                break
            out.append(t)
            acc += t.total_flops
        ranked = out
    if top is not None:
        ranked = ranked[:top]
    return ranked
