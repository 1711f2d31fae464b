"""Tasks: the tunable kernels (fused TIR functions) of the inference and the training graph.

A task is one workload (a fused PrimFunc, identified by its structural hash as MetaSchedule's
database does), with the number of times the graphs call it and its FLOPs per call
(``tvm.s_tir.analysis.estimate_tir_flops``: multiply-adds count 2).
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field

import tvm
import tvm_ffi
from tvm import relax
from tvm.s_tir import meta_schedule as ms
from tvm.s_tir.analysis import estimate_tir_flops

from .training_graph.lift import SLOTS, lift_frozen
from .training_graph.pooling import LEGALIZE


def fuse(mod: tvm.IRModule, winograd=None) -> tvm.IRModule:
    """Legalize and fuse a Relax module: every fused PrimFunc is one kernel of the graph.

    A matmul by a transposed 2-D operand (a linear layer's ``x @ W^T``) becomes one kernel that
    reads ``W`` in place (``FuseTransposeMatmul``): otherwise each forward pass copies the
    transposed weight first, 302 MB of traffic per step for AlexNet's first linear layer.

    ``winograd``: None (every convolution in its direct form), ``"all"`` (each convolution
    :func:`thomas_tune.training_graph.winograd_form.eligible` takes, in the Winograd form) or a set
    of
    :class:`thomas_tune.training_graph.winograd_form.Conv` (those convolutions only, e.g. from
    :func:`choose_winograd`).

    A function marked with :data:`thomas_tune.training_graph.lift.ATTR` (an export's step) then has
    the kernels that read its frozen parameters alone lifted into a function of its own
    (:func:`thomas_tune.training_graph.lift.lift_frozen`), the Winograd weight transforms among
    them.

    A max pool with a small window is legalized as one injective kernel
    (:mod:`thomas_tune.training_graph.pooling`), which element-wise work after it may join and the
    kernel that makes its input never does.

    A kernel that only reshapes its input inside a dataflow block (a BatchNorm's per-channel
    values to (1, C, 1, 1), a flatten) becomes a view (``RewriteDataflowReshape``, as the
    build does anyway): the build never launches it, so it is no task and no call of the
    module (76 calls of MobileNetV2 1.0@224's step).
    """
    if winograd:
        from .training_graph import winograd_form as W
        mod, _ = W.rewrite(mod, (lambda call, conv: True) if winograd == "all"
                           else (lambda call, conv: conv in winograd))
    seq = tvm.transform.Sequential([
        relax.transform.FuseTransposeMatmul(),
        relax.transform.LegalizeOps(customize_legalize_map=LEGALIZE),
        relax.transform.AnnotateTIROpPattern(),
        relax.transform.FoldConstant(),
        relax.transform.FuseOps(),
        relax.transform.FuseTIR(),
    ])
    with tvm.transform.PassContext(opt_level=3):
        # lifted once fused: a kernel that reads a frozen parameter beside other inputs (a
        # bias and its reshape fused into a convolution) stays as it is, its workload unchanged
        mod = short_kernel_names(lift_frozen(seq(mod)))
        return relax.transform.RewriteDataflowReshape()(mod)


def lifted_slots(fused: tvm.IRModule) -> dict[str, list[str] | None]:
    """The frozen slots of each function of a module :func:`fuse` made that was split for
    lifting (:func:`thomas_tune.training_graph.lift.lift_frozen`, which sets
    :data:`thomas_tune.training_graph.lift.SLOTS`), by function name: per slot, the constant input
    it takes as it is, or "" for the next output of its ``NAME_frozen``; None where nothing is
    lifted (the built function then takes its inputs as they are). What the runtime needs to call
    the built functions (the manifest keeps it)."""
    out = {}
    for gv, f in fused.functions.items():
        if isinstance(f, relax.Function) and f.attrs and SLOTS in f.attrs:
            slots = [str(s) for s in f.attrs[SLOTS]]
            out[gv.name_hint] = slots if "" in slots else None
    return out


#: the longest kernel name a fused PrimFunc keeps. FuseOps names a fused kernel after its
#: operators and cuts the name at about 250 characters; PoCL fails to link an OpenCL kernel whose
#: name (with the ``_kernel`` suffix the code generator adds) reaches 254 characters, and the
#: process then dies.
MAX_KERNEL_NAME = 200


def short_kernel_names(mod: tvm.IRModule) -> tvm.IRModule:
    """``mod`` with every PrimFunc whose name is longer than :data:`MAX_KERNEL_NAME` renamed to
    its first 180 characters, ``_`` and 8 hex digits of the SHA-1 of the whole name (distinct
    names stay distinct), and the Relax functions' calls to it renamed too. Workload keys do
    not change: they hash the function alone (:func:`workload_key`)."""
    import hashlib
    from tvm.relax.expr import _update_type
    new = {}
    for gv, f in mod.functions.items():
        if isinstance(f, tvm.tirx.PrimFunc) and len(gv.name_hint) > MAX_KERNEL_NAME:
            new[gv] = tvm.ir.GlobalVar(f"{gv.name_hint[:180]}_"
                                       f"{hashlib.sha1(gv.name_hint.encode()).hexdigest()[:8]}")
            _update_type(new[gv], gv.ty)  # the callers' normalisation needs the callee's type
    if not new:
        return mod

    @relax.expr_functor.mutator
    class _Rename(relax.PyExprMutator):
        def visit_global_var_(self, op):
            return new.get(op, op)

    out = tvm.IRModule(attrs=mod.attrs)
    for gv, func in mod.functions.items():
        if gv in new:
            if func.attrs is not None and "global_symbol" in func.attrs:
                func = func.with_attr("global_symbol", new[gv].name_hint)
            out[new[gv]] = func
        elif isinstance(func, relax.Function):
            out[gv] = _Rename().visit_expr(func)
        else:
            out[gv] = func
    return out


def workload_module(func: tvm.tirx.PrimFunc) -> tvm.IRModule:
    """The workload of a fused PrimFunc as tasks and tuning records hold it: an IRModule whose
    ``main`` is the kernel."""
    return tvm.IRModule({"main": func.with_attr("global_symbol", "main")})


def workload_key(func: tvm.tirx.PrimFunc) -> str:
    """The workload key of a fused PrimFunc as MetaSchedule's task extraction and the tuning
    log key it: the structural hash of :func:`workload_module`, in decimal."""
    return str(tvm_ffi.structural_hash(workload_module(func)))


def callees(func: relax.Function) -> dict[str, int]:
    """GlobalVar name -> number of calls in a Relax function (call_tir and direct calls)."""
    counts: dict[str, int] = {}

    def visit(e):
        if isinstance(e, relax.Call):
            gv = None
            if getattr(e.op, "name", "").startswith("relax.call_tir") and e.args:
                gv = e.args[0]
            elif isinstance(e.op, relax.GlobalVar):
                gv = e.op
            if isinstance(gv, relax.GlobalVar):
                counts[gv.name_hint] = counts.get(gv.name_hint, 0) + 1

    relax.analysis.post_order_visit(func.body, visit)
    return counts


def kernel_calls(mod: tvm.IRModule) -> dict[str, int]:
    """Workload key -> calls, summed over the Relax functions of a fused module (each
    ``call_tir`` once; a kernel inside a loop would count once)."""
    names: dict[str, int] = {}
    for func in mod.functions.values():
        if isinstance(func, relax.Function):
            for name, n in callees(func).items():
                names[name] = names.get(name, 0) + n
    out: dict[str, int] = {}
    for gv, func in mod.functions.items():
        if isinstance(func, tvm.tirx.PrimFunc) and gv.name_hint in names:
            k = workload_key(func)
            out[k] = out.get(k, 0) + names[gv.name_hint]
    return out


def _step_ms(calls: dict[str, int], kernel_ms, untimed_free: bool) -> float | None:
    """ms per step of the kernels ``calls`` (workload key -> calls) by ``kernel_ms``; None
    when none has a time, or when one has none and ``untimed_free`` is false."""
    times = {k: kernel_ms(k) for k in calls}
    timed = {k: t for k, t in times.items() if t is not None}
    if not timed or (len(timed) < len(times) and not untimed_free):
        return None
    return sum(t * calls[k] for k, t in timed.items())


def choose_winograd(mod: tvm.IRModule, kernel_ms, untimed_ms=None) -> set:
    """The convolutions of the unfused Relax module ``mod`` to compute in the Winograd form:
    those whose Winograd kernels take less time, by ``kernel_ms``, than the direct kernels
    they replace.

    ``kernel_ms(key)``: ms per call of the workload with that key (its best tuning record, or
    its default schedule's time), None when unknown. ``untimed_ms(workloads)``, optional:
    given ``{key: workload IRModule}`` of kernels ``kernel_ms`` has no time for, the times it
    knows of them (``{key: ms per call}``; a tuning log's default-schedule times, which need
    the workload to tell whether they still hold). For each eligible convolution (grouped
    by :class:`thomas_tune.training_graph.winograd_form.Conv`: sites of one shape share their
    kernels), the kernels that appear and those that go away when only it is rewritten are compared,
    time x calls: every kernel that appears must have a time; one that goes away without a time
    counts as free (so an untimed kernel never tips the choice towards the Winograd form).
    Returns a set of ``Conv``, empty when no convolution qualifies (then nothing is fused
    twice).

    In a module that also computes data gradients (a training step: transposed convolutions
    among its eligible ones), only those are candidates, and only for the filter sizes of
    :data:`thomas_tune.training_graph.winograd_form.GRADIENT_FILTERS`; its forward convolutions stay
    direct. Their outputs decide the ReLU masks and max-pooling windows through which the backward
    pass routes every gradient, and the Winograd form's rounding (about 3x the direct form's
    for F(2x2, 5x5), 2.5x for F(2x2, 3x3)) decided enough of them otherwise for AlexNet@224's
    step at batch 32 to fail the step check, on PoCL and on the H200, where the same tuned
    records in the direct form pass (docs/journal/precision.md). An error in a gradient stays
    an error of its size, so the data gradients of 3x3 layers keep the faster form; a 5x5
    layer's puts the gradients below it over the step check's bound."""
    from .training_graph import winograd_form as W
    convs = W.candidates(mod)
    if not convs:
        return set()
    known: dict[str, float] = {}

    def calls_and_times(fused: tvm.IRModule) -> dict[str, int]:
        calls = kernel_calls(fused)
        need = {k for k in calls if k not in known and kernel_ms(k) is None}
        if untimed_ms is not None and need:
            funcs = [f for f in fused.functions.values() if isinstance(f, tvm.tirx.PrimFunc)]
            known.update(untimed_ms({k: workload_module(f) for f in funcs
                                     if (k := workload_key(f)) in need}))
        return calls

    def ms(key):
        t = kernel_ms(key)
        return known.get(key) if t is None else t

    base = calls_and_times(fuse(mod))
    chosen = set()
    for conv in sorted(convs, key=repr):
        calls = calls_and_times(fuse(mod, {conv}))
        added = {k: n for k, n in calls.items() if k not in base}
        removed = {k: n for k, n in base.items() if k not in calls}
        # every new kernel must be timed; a kernel that goes away untimed (a bias's reshape
        # that the Winograd form fuses into its output transform) counts as free, which can
        # only favour the direct form
        new = _step_ms(added, ms, untimed_free=False)
        old = _step_ms(removed, ms, untimed_free=True)
        if new is not None and old is not None and new < old:
            chosen.add(conv)
    return chosen


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


def extract(graphs: dict[str, tvm.IRModule], target: tvm.target.Target,
            winograd: dict | None = None) -> list[Task]:
    """Tasks of several Relax graphs (name -> unfused module), deduplicated by workload.

    ``winograd``: None, for tuning: a graph with convolutions the Winograd form takes
    (:mod:`thomas_tune.training_graph.winograd_form`) gives the tasks of both forms, so that tuning
    finds what each costs (a kernel both forms call is counted once); or graph name -> the set of
    convolutions a build computes in that form
    (:func:`thomas_tune.compiler.compile.winograd_choice`): the tasks of that build only. For a GPU
    target the loss's kernel is left out: the build writes it as one work-group
    (:func:`thomas_tune.training_graph.loss.gpu_kernel`), which nothing tunes.

    Returns tasks sorted by total FLOPs (calls x FLOPs per call), largest first.

    Extraction legalizes and fuses every graph (seconds for a training step), so its tasks are
    kept for the life of the process per graphs (structural hash), target and Winograd choice:
    ``remeasure``, ``tune`` and ``export`` of one model in one process (the demo) extract once.
    Each call returns new :class:`Task` objects (their ``calls`` may be changed); the workload
    modules are shared (TVM's modules are immutable).
    """
    memo = (tuple((name, int(tvm_ffi.structural_hash(mod))) for name, mod in graphs.items()),
            str(target), None if winograd is None else
            tuple(sorted((name, repr(c if isinstance(c, str) else sorted(map(repr, c or ()))))
                         for name, c in winograd.items())))
    if memo not in _EXTRACTED:
        _EXTRACTED[memo] = _extract(graphs, target, winograd)
    return [dataclasses.replace(t, calls=dict(t.calls)) for t in _EXTRACTED[memo]]


#: extract's tasks made in this process, per graphs, target and Winograd choice
_EXTRACTED: dict[tuple, list[Task]] = {}


def _extract(graphs: dict[str, tvm.IRModule], target: tvm.target.Target,
             winograd: dict | None) -> list[Task]:
    from .training_graph import winograd_form as W
    from .training_graph.loss import KERNEL_ATTR as LOSS_KERNEL
    from .target import is_gpu
    gpu = is_gpu(target)
    by_key: dict[int, Task] = {}
    for graph_name, mod in graphs.items():
        if winograd is not None:
            forms = [fuse(mod, winograd.get(graph_name))]
        else:
            forms = [fuse(mod)]
            wino = W.candidates(mod)  # the kernels of every form the choice may take
            if wino:
                forms.append(fuse(mod, wino))
        seen: dict[int, int] = {}
        for form in forms:
            for et in ms.relax_integration.extract_tasks(form, target):
                attrs = et.dispatched[0]["main"].attrs
                if gpu and attrs is not None and LOSS_KERNEL in attrs:
                    # built as one work-group (thomas_tune.training_graph.loss.gpu_kernel), not
                    # tuned
                    continue
                key = tvm_ffi.structural_hash(et.dispatched[0])
                task = by_key.get(key)
                if task is None:
                    try:
                        flops = float(estimate_tir_flops(et.dispatched[0]))
                    except Exception:  # some kernels (e.g. int64 index math) have no estimate
                        flops = 0.0
                    task = by_key[key] = Task(et.task_name, et.dispatched[0], flops,
                                              extracted=et)
                # a kernel both forms call counts once
                seen[key] = max(seen.get(key, 0), int(et.weight))
        for key, n in seen.items():
            task = by_key[key]
            task.calls[graph_name] = task.calls.get(graph_name, 0) + n
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
