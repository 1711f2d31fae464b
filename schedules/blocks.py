"""Predicates on TIR blocks that the schedule rules branch on: contractions, padding, strides."""

from __future__ import annotations

import tvm


def strided_read(block) -> bool:
    """Whether ``block`` reads a buffer at an index that divides, or takes the remainder of, an
    expression of its iterators (``floordiv``, ``floormod``, ``/``, ``%``)."""
    import tvm_ffi

    iters = [iv.var for iv in block.iter_vars]
    found = []

    def visit(node) -> None:
        if _uses(node, iters):
            found.append(node)

    for region in block.reads:
        for r in region.region:
            tvm_ffi.structural_walk(r.min, [(cls, visit) for cls in (
                tvm.tirx.FloorDiv, tvm.tirx.FloorMod, tvm.tirx.Div, tvm.tirx.Mod)])
            if found:
                return True
    return False


def padding_block(block) -> bool:
    """Whether ``block`` only pads (or dilates) a tensor: one buffer read, and the value stored
    is ``if_then_else(in bounds, that buffer's element, constant)``, as TOPI's ``pad`` and
    ``conv2d_transpose``'s dilation write it."""
    store = block.body
    if not isinstance(store, tvm.tirx.BufferStore) or len(block.reads) != 1:
        return False
    value = store.value
    if not (isinstance(value, tvm.ir.expr.Call) and value.op.name.endswith("if_then_else")):
        return False
    taken, other = value.args[1], value.args[2]
    return (isinstance(taken, tvm.ir.expr.TensorLoad) and isinstance(other, tvm.tirx.FloatImm)
            and taken.source.same_as(block.reads[0].source))


def contraction(block) -> bool:
    """Whether ``block`` sums products of two or more tensors (a reduction iterator, two or more
    buffers read): a convolution, either of its gradients, a matmul."""
    return (len(block.reads) >= 2
            and any(int(iv.iter_type) == 2 for iv in block.iter_vars))  # 2: CommReduce


def indexed_contraction(block) -> bool:
    """Whether two or more of ``block``'s operands are indexed by its reduction iterators (a
    matmul or a convolution's weight gradient, as opposed to a plain sum of one operand)."""
    reduce_vars = [iv.var for iv in block.iter_vars
                   if iv.iter_type == tvm.tirx.IterVar.CommReduce]
    indexed = sum(1 for region in block.reads
                  if any(_uses(r.min, reduce_vars) for r in region.region))
    return indexed >= 2


def _uses(expr, variables) -> bool:
    """Whether TIR expression ``expr`` refers to one of ``variables`` (compared by identity:
    ``==`` on TIR variables builds an expression)."""
    used = tvm.tirx.analysis.undefined_vars(expr, [])
    return any(u.same_as(v) for u in used for v in variables)


def reduction_blocks(func: tvm.tirx.PrimFunc) -> list:
    """The reduction blocks (blocks with an init statement) of ``func``, in post order."""
    import tvm_ffi

    found = []

    def visit(block) -> None:
        if block.init is not None:
            found.append(block)

    tvm_ffi.structural_walk(func.body, [(tvm.s_tir.SBlock, visit)], order="post")
    return found


def tuple_reduction(func: tvm.tirx.PrimFunc) -> bool:
    """True when a reduction block of ``func`` writes several buffers at once (the argmax of
    max-pooling's backward): TVM cannot split such a reduction across threads ("no matched
    reducer"), so only the thread-per-output schedules apply."""
    return any(len(block.writes) > 1 for block in reduction_blocks(func))
