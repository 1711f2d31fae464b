"""Vector casts of comparisons in GPU kernels, written so that OpenCL C computes what TIR means.

In TIR a comparison is ``bool`` and a cast of it to a number is 0 or 1, lane by lane: Relax's
``where`` lowers to ``Select(0 < Cast(int64, cond), a, b)``, and a ReLU's backward mask so
reaches the kernel as a cast of ``0 < x``. TVM's OpenCL generator writes a vector cast as a
conversion of the comparison's value (``convert_int4(a < b)``), but in OpenCL C a comparison of
vectors gives -1 (every bit set) where it holds, 0 elsewhere (OpenCL C specification 3.0,
section 6.15.5, "Relational Operators"), so the cast gives -1 where TIR means 1, and
``0 < convert_int4(a < b)`` is false everywhere: the kernel selects the ``else`` side wherever
its mask loop is vectorized (the tuner's kernel check fails such candidates, so their fast
schedules were lost). A scalar comparison is 0 or 1 in C and OpenCL C alike.

The rewrite (:func:`vector_bool_casts`) replaces each cast of a vector of ``bool`` to a number
by ``Select(cond, 1, 0)`` of the same lanes, which the generator writes as OpenCL's
``select``: it takes the side by the comparison's sign bit, as the specification defines
``select`` for vectors. Kernels without such casts are left as they are, to the byte.
"""

from __future__ import annotations

import tvm
import tvm_ffi
from tvm import tirx


def _bool_vector(ty) -> bool:
    t = tvm.DataType(str(ty))
    return t.type_code == tvm.DataTypeCode.BOOL and t.lanes > 1


def vector_bool_casts(func: tirx.PrimFunc) -> tirx.PrimFunc:
    """``func`` with every ``Cast(T x n, cond)`` of a vector of ``n`` bools to numbers of type
    ``T`` replaced by ``Select(cond, broadcast(1, n), broadcast(0, n))``; the same object when
    it has none."""
    found = []

    def on_cast(node):
        if not _bool_vector(node.value.ty):
            return node
        lanes = tvm.DataType(str(node.ty)).lanes
        scalar = str(tvm.DataType(str(node.ty)).with_lanes(1))
        one = tirx.Broadcast(tirx.const(1, scalar), lanes)
        zero = tirx.Broadcast(tirx.const(0, scalar), lanes)
        found.append(node)
        return tirx.Select(node.value, one, zero)

    body = tvm_ffi.structural_map(func.body, [(tirx.Cast, on_cast)])
    return func.with_body(body) if found else func


@tvm.transform.module_pass(opt_level=0, name="ThomasTuneVectorBoolCasts")
def VectorBoolCasts(mod: tvm.IRModule, _ctx) -> tvm.IRModule:  # noqa: N802 (named as TVM's passes)
    """:func:`vector_bool_casts` on each kernel of a lowered module (after TVM's vectorizer);
    a module without such casts is returned as it came."""
    out, changed = tvm.IRModule(mod.functions, attrs=mod.attrs), False
    for gv, func in mod.functions.items():
        if isinstance(func, tirx.PrimFunc):
            rewritten = vector_bool_casts(func)
            if not rewritten.same_as(func):
                out[gv], changed = rewritten, True
    return out if changed else mod
