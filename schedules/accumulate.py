"""Two-level sums in GPU kernels: a long sum kept in one register per output is split into
partial sums, each started at zero and added to the output's running sum when complete.

A scheduled GPU kernel (a tuning record's or a default schedule) keeps one accumulator per
output in a thread's registers (a ``local`` buffer) and adds every term of the output's sum to
it in order: AlexNet's second convolution adds 64 x 5 x 5 = 1,600 products per output in one
chain. The rounding of a float32 sum of n terms in a row grows with n (about sqrt(n) roundings
of the running value for random-sign terms, n in the worst case; Higham 2002, "Accuracy and
Stability of Numerical Algorithms", 2nd ed., sec. 4.2); a sum of p partial sums of n / p terms
each rounds about sqrt(n / p) + sqrt(p) times. On the CPU the same sums are split before
scheduling (:func:`thomas_tune.schedules.split_long_sums`); a GPU schedule's loops are the
tuner's choice, so the split is made after it, on the lowered kernel, for every schedule alike.

The rewrite (:func:`two_level_sums`) takes each ``local`` float buffer whose elements are only
accumulated (``acc[i] = acc[i] + term``) inside a loop nest, and picks one summed loop of that
nest (a loop whose variable indexes no accumulator: its iterations add to the same outputs):
and a run of its iterations (a divisor of its extent) such that the terms of one run are
nearest to sqrt(terms per output). At the start of each run a second buffer of partial sums,
of the accumulators' size, is set to zero; it takes the run's terms and is added to the
accumulators at the run's end. Each output gets one more add per run, and the thread twice
the registers for its accumulators, which is why the rewrite is bounded (:data:`CHAIN`,
:data:`MAX_ACCUMULATORS`).
"""

from __future__ import annotations

import math

import tvm
import tvm_ffi
from tvm import tirx

#: sums of fewer terms per output than this stay one chain (the CPU split's threshold too)
CHAIN = 512
#: accumulators per thread (the local buffer's values times its virtual threads) above which
#: a kernel is left as it is: the partial sums double them, and a thread that spills its
#: registers to memory is many times slower. 64 more 32-bit registers stay well within an
#: NVIDIA thread's 255 (CUDA C++ Programming Guide, "Technical Specifications per Compute
#: Capability").
MAX_ACCUMULATORS = 64

_SERIAL = (tirx.ForKind.SERIAL, tirx.ForKind.UNROLLED)


def _children(stmt) -> list:
    if isinstance(stmt, tirx.SeqStmt):
        return list(stmt.seq)
    if isinstance(stmt, tirx.IfThenElse):
        return [s for s in (stmt.then_case, stmt.else_case) if s is not None]
    body = getattr(stmt, "body", None)
    return [body] if isinstance(body, tirx.Stmt) else []


def _reads(expr, buffer) -> bool:
    found = []
    tvm_ffi.structural_walk(expr, [(tvm.ir.expr.TensorLoad, lambda n: found.append(
        n.source.same_as(buffer)))])
    return any(found)


def _uses(expr, var) -> bool:
    found = []
    tvm_ffi.structural_walk(expr, [(tvm.ir.expr.Var, lambda n: found.append(n.same_as(var)))])
    return any(found)


def _accumulation(store, buffer):
    """The term of ``store`` when it is ``buffer[i] = buffer[i] + term`` with a term that reads
    no ``buffer``, else None."""
    value = store.value
    if not isinstance(value, tirx.Add):
        return None
    for acc, term in ((value.a, value.b), (value.b, value.a)):
        if (isinstance(acc, tvm.ir.expr.TensorLoad) and acc.source.same_as(buffer)
                and len(acc.indices) == len(store.indices)
                and all(tvm_ffi.structural_equal(x, y)
                        for x, y in zip(acc.indices, store.indices))
                and not _reads(term, buffer)):
            return term
    return None


class _Uses:
    """Where a local buffer is accessed: the accumulations with the loops around them inside
    its allocation (loops around the allocation start the sums again), and the loops around
    every other access."""

    def __init__(self, buffer):
        self.buffer = buffer
        self.accumulations: list[tuple[object, list]] = []  # (store, loops outer to inner)
        self.others: list[list] = []
        self.around: list = []  # the loops around the allocation

    def visit(self, stmt, loops: list) -> None:
        if isinstance(stmt, tirx.AllocBuffer) and stmt.buffer.same_as(self.buffer):
            self.around = list(loops)
            return
        if isinstance(stmt, tirx.BufferStore):
            if stmt.buffer.same_as(self.buffer):
                if _accumulation(stmt, self.buffer) is not None:
                    self.accumulations.append((stmt, list(loops)))
                else:
                    self.others.append(list(loops))
            elif _reads(stmt.value, self.buffer) or any(_reads(i, self.buffer)
                                                        for i in stmt.indices):
                self.others.append(list(loops))
            return
        exprs = [getattr(stmt, k) for k in ("condition", "value", "min", "extent")
                 if isinstance(getattr(stmt, k, None), tvm.ir.expr.Expr)]
        if any(_reads(e, self.buffer) for e in exprs):
            self.others.append(list(loops))
        if isinstance(stmt, tirx.Evaluate):
            return
        inner = loops + [stmt] if isinstance(stmt, tirx.For) else loops
        for child in _children(stmt):
            self.visit(child, inner)


def _split_loop(uses: _Uses, chain: int):
    """Where to split the accumulations, or None: a summed loop common to every accumulation,
    serial, around no other access of the buffer, and how many of its iterations each partial
    sum takes (a divisor of its extent; 1: one iteration, the loops inside it whole), so that
    a partial sum's terms are nearest sqrt(terms) with at least two terms and two partial
    sums per output. Returns ``(loop, iterations)``."""
    if not uses.accumulations:
        return None
    first_store, first_loops = uses.accumulations[0]

    def summed(store, loops):
        return [lp for lp in loops[len(uses.around):]
                if not any(_uses(i, lp.loop_var) for i in store.indices)]

    summed_first = summed(first_store, first_loops)
    extents = []
    for lp in summed_first:
        if not isinstance(lp.extent, tirx.IntImm) or lp.kind not in _SERIAL:
            return None
        extents.append(int(lp.extent))
    terms = math.prod(extents)
    if terms < chain:
        return None
    for store, loops in uses.accumulations[1:]:
        others = summed(store, loops)
        if len(others) != len(summed_first) or not all(
                a.same_as(b) for a, b in zip(others, summed_first)):
            return None
    best, best_gap = None, math.inf
    for k, lp in enumerate(summed_first):
        if any(any(lp.same_as(x) for x in loops) for loops in uses.others):
            continue
        for f in (d for d in range(1, extents[k]) if extents[k] % d == 0):
            inner = f * math.prod(extents[k + 1:])
            if inner < 2 or terms // inner < 2:
                continue
            gap = abs(math.log(inner) - 0.5 * math.log(terms))
            if gap < best_gap - 1e-9:
                best, best_gap = (lp, f), gap
    return best


def _with_partial_sums(loop, iterations, buffer, alloc_annotations):
    """``loop`` in runs of ``iterations`` iterations, with a buffer of partial sums set to zero
    at the start of each run, the run's accumulations into ``buffer`` made into it, and it
    added to ``buffer`` at the run's end."""
    size = int(buffer.shape[0])
    dtype = buffer.dtype
    partial = tirx.decl_buffer(buffer.shape, dtype, name=f"{buffer.name}_partial",
                               scope="local")
    index_type = str(buffer.shape[0].ty)

    def to_partial_store(store):
        if store.buffer.same_as(buffer):
            return tirx.BufferStore(partial, store.value, store.indices)
        return store

    def to_partial_load(load):
        if load.source.same_as(buffer):
            return tirx.BufferLoad(partial, load.indices)
        return load

    body = tvm_ffi.structural_map(loop.body, [(tvm.ir.expr.TensorLoad, to_partial_load),
                                              (tirx.BufferStore, to_partial_store)])
    j = tirx.Var("j", index_type)
    zero = tirx.For(j, tirx.IntImm(index_type, 0), tirx.IntImm(index_type, size),
                    tirx.ForKind.UNROLLED,
                    tirx.BufferStore(partial, tirx.FloatImm(dtype, 0.0), [j]))
    k = tirx.Var("k", index_type)
    add = tirx.For(k, tirx.IntImm(index_type, 0), tirx.IntImm(index_type, size),
                   tirx.ForKind.UNROLLED,
                   tirx.BufferStore(buffer, tirx.BufferLoad(buffer, [k])
                                    + tirx.BufferLoad(partial, [k]), [k]))
    if iterations > 1:
        # a run is the iterations whose index divided by ``iterations`` is the same: the loop
        # and its index arithmetic stay as scheduled, the start and end of a run are tests of
        # the loop variable (the same for every thread)
        loop_type = str(loop.loop_var.ty)
        at = tirx.FloorMod(loop.loop_var - loop.min, tirx.IntImm(loop_type, iterations))
        zero = tirx.IfThenElse(at == tirx.IntImm(loop_type, 0), zero, None)
        add = tirx.IfThenElse(at == tirx.IntImm(loop_type, iterations - 1), add, None)
    # the partial sums are allocated before the loop: they live across the iterations of a run
    return tirx.SeqStmt([
        tirx.AllocBuffer(partial, alloc_annotations),
        tirx.For(loop.loop_var, loop.min, loop.extent, loop.kind,
                 tirx.SeqStmt([zero, body, add]), loop.thread_binding, loop.annotations)])


def two_level_sums(func: tirx.PrimFunc, chain: int | None = None,
                   max_accumulators: int | None = None) -> tirx.PrimFunc:
    """``func`` (a lowered GPU kernel: after ``FlattenBuffer``, its local buffers flat) with
    the long sums of its register accumulators taken in two levels (module docstring).

    A ``local`` buffer is rewritten when it is one-dimensional, of a float type, of at most
    ``max_accumulators`` values counting its virtual threads, and every access to it inside
    the picked loop is an accumulation; each output's terms, the product of the summed loops'
    extents, number at least ``chain``. Anything else is left as it is: the result computes
    the same sums, in another order where it changed. ``chain`` and ``max_accumulators``
    default to :data:`CHAIN` and :data:`MAX_ACCUMULATORS`."""
    chain = CHAIN if chain is None else chain
    max_accumulators = MAX_ACCUMULATORS if max_accumulators is None else max_accumulators
    found = []

    def on_alloc(node):
        b = node.buffer
        if (b.scope() == "local" and len(b.shape) == 1 and isinstance(b.shape[0], tirx.IntImm)
                and b.dtype.startswith("float")):
            found.append(node)

    tvm_ffi.structural_walk(func.body, [(tirx.AllocBuffer, on_alloc)])
    if not found:
        return func
    vthreads = []

    def on_attr(node):
        if node.attr_key == "virtual_thread" and isinstance(node.value, tirx.IntImm):
            vthreads.append(int(node.value))

    tvm_ffi.structural_walk(func.body, [(tirx.AttrStmt, on_attr)])
    copies = math.prod(vthreads)
    summed = []  # the buffers some store accumulates into: only those can be rewritten

    def on_store(node):
        if _accumulation(node, node.buffer) is not None:
            summed.append(node.buffer)

    tvm_ffi.structural_walk(func.body, [(tirx.BufferStore, on_store)])
    targets = {}
    for alloc in found:
        buffer = alloc.buffer
        if (int(buffer.shape[0]) * copies > max_accumulators
                or not any(b.same_as(buffer) for b in summed)):
            continue
        uses = _Uses(buffer)
        uses.visit(func.body, [])
        split = _split_loop(uses, chain)
        if split is not None:
            targets[split[0]] = (split[1], buffer, alloc.annotations)
    if not targets:
        return func

    def on_for(node):
        for loop, (iterations, buffer, alloc_annotations) in targets.items():
            if node.same_as(loop):
                return _with_partial_sums(node, iterations, buffer, alloc_annotations)
        return node

    body = tvm_ffi.structural_map(func.body, [(tirx.For, on_for)], order="pre")
    return func.with_body(body)


def _without_dim_align(func: tirx.PrimFunc) -> tirx.PrimFunc:
    """``func`` with the ``buffer_dim_align`` annotations of its allocations removed: lowering
    has applied them (the flat buffer is padded), and TVM's passes, run again on the flat
    buffer, would apply them to an axis it no longer has."""
    def strip(node):
        if "buffer_dim_align" not in node.annotations:
            return node
        kept = {k: v for k, v in node.annotations.items() if k != "buffer_dim_align"}
        return tirx.AllocBuffer(node.buffer, kept)

    return func.with_body(tvm_ffi.structural_map(func.body, [(tirx.AllocBuffer, strip)]))


@tvm.transform.module_pass(opt_level=0, name="ThomasTuneTwoLevelSums")
def TwoLevelSums(mod: tvm.IRModule, _ctx) -> tvm.IRModule:  # noqa: N802 (named as TVM's passes)
    """:func:`two_level_sums` as a pass on a module of scheduled kernels (its target bound):
    each kernel is lowered to loops (:func:`to_loops`) and rewritten; a kernel the rewrite
    changes goes on lowered, every other one as it came, so that TVM's pipeline after this
    pass lowers it once."""
    out = tvm.IRModule(mod.functions, attrs=mod.attrs)
    lower = to_loops()
    for gv, func in mod.functions.items():
        if not isinstance(func, tirx.PrimFunc):
            continue
        lowered = lower(tvm.IRModule({gv: func}))[gv]
        rewritten = two_level_sums(lowered)
        if not rewritten.same_as(lowered):
            out[gv] = _without_dim_align(rewritten)
    return out


#: the name of the TIR pipeline that GPU kernels are built with (:func:`gpu_tir_pipeline`)
PIPELINE = "thomas_tune_gpu"


def to_loops() -> tvm.transform.Pass:
    """TVM's passes that take a scheduled kernel to loops and flat buffers, in the order of its
    default TIR pipeline (``s_tir``) up to ``FlattenBuffer``: the form
    :func:`two_level_sums` rewrites."""
    from tvm import s_tir
    return tvm.transform.Sequential([
        s_tir.transform.CanonicalizeLoop(), s_tir.transform.LowerCrossThreadReduction(),
        s_tir.transform.LowerInitBlock(), s_tir.transform.PlanAndUpdateBufferAllocationLocation(),
        s_tir.transform.ConvertBlocksToOpaque(), s_tir.transform.LiftThreadBinding(),
        s_tir.transform.ManifestSharedMemoryLocalStage(), s_tir.transform.CompactBufferAllocation(),
        s_tir.transform.LowerAutoCopy(), s_tir.transform.UnifyThreadBinding(),
        s_tir.transform.LowerMatchBuffer(), s_tir.transform.StmtSimplify(),
        s_tir.transform.InjectPermutedLayout(), s_tir.transform.AnnotateIrregularLoop(),
        s_tir.transform.InjectSoftwarePipeline(), s_tir.transform.TransformMmaBufferLayout(),
        s_tir.transform.LowerOpaqueBlock(), tirx.transform.FlattenBuffer()])


def gpu_tir_pipeline():
    """TVM's default TIR pipeline (``s_tir``) with :class:`TwoLevelSums` made first: the kernels
    whose sums it splits reach the default pipeline lowered (its passes up to ``FlattenBuffer``
    find nothing left to do in them), the others as scheduled; and
    :class:`~.bool_casts.VectorBoolCasts` made last, on the vectorized kernels. Returns what a
    TIR pipeline factory returns (``tvm.tirx.get_tir_pipeline``): the pass, and the host and
    device finalisation passes. Registered as :data:`PIPELINE`."""
    from .bool_casts import VectorBoolCasts
    base, host, device = tvm.tirx.get_tir_pipeline("s_tir")
    return tvm.transform.Sequential([TwoLevelSums, base, VectorBoolCasts]), host, device


tvm.tirx.register_tir_pipeline(PIPELINE, gpu_tir_pipeline)


def tir_pipeline(target: tvm.target.Target) -> str:
    """The name of the TIR pipeline to lower ``target``'s kernels with: :data:`PIPELINE` for
    GPU targets (:func:`thomas_tune.target.is_gpu`: OpenCL, CUDA, Vulkan, ...), TVM's
    ``"default"`` for CPUs, whose long sums are split before scheduling."""
    from ..target import is_gpu
    return PIPELINE if is_gpu(target) else "default"
