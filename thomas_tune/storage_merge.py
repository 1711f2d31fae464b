"""One storage for tensors of different dtypes: the memory plan of a half-storage step.

Relax's ``StaticPlanBlockMemory`` places the tensors of a function in storage *tokens* and lends
a token whose tensors have died to a later tensor, but only to one of the same dtype (TVM's
``src/relax/transform/static_plan_block_memory.cc``: the pool of free tokens is kept per
dtype). In a float32 step that is no restriction. In a step whose layer outputs are stored as
float16 (:mod:`thomas_tune.half_storage`) it is one: the float16 tokens of the forward tensors
kept for the backward are freed one by one as the backward reads them, while the backward's
own tensors (the float32 activation gradients, the float32 copies its convolutions read) take
new float32 tokens. The device then holds both sets.

:func:`merge_storages` places the tensors ``StaticPlanBlockMemory`` planned again, without
regard to dtype, right after that pass: each tensor lives from its ``alloc_tensor`` to the last
use of anything made from it (values bound to it, the field of a tuple it is in, the results
of calls taking it); the largest tensor first, each goes into the smallest storage already
made that holds it and whose tensors all live at other times, else into a new storage of its
size (offline, by size: a tensor in program order would first take a storage that a larger,
later tensor needed). Each storage is made where its first tensor is; the virtual machine
makes a tensor of any dtype in a storage (``vm.builtin.alloc_tensor``), and
``KillAfterLastUse`` releases each storage after its last tensor. Only the functions with a
float16 storage are planned again: a float32 step's plan stays TVM's, byte for byte. No kernel
changes, so no workload (and no tuning record) does.

What remains is the float16 forward tensors kept for the backward (nested lifetimes: no two
share a storage) beside the float32 tensors of the backward, the largest of which (an
activation gradient at 112x112) is twice any float16 storage freed before it: without
offsets into one storage, freed float16 storages cannot hold it.
"""

from __future__ import annotations

import tvm
from tvm import relax

ALLOC_STORAGE = "relax.memory.alloc_storage"


ALLOC_TENSOR = "relax.memory.alloc_tensor"


def _is_op(value, name: str) -> bool:
    return isinstance(value, relax.Call) and isinstance(value.op, tvm.ir.Op) and \
        value.op.name == name


def _tensor_bytes(call: relax.Call) -> int:
    """Bytes of the tensor an ``alloc_tensor`` call makes."""
    n = 1
    for v in call.args[2].values:
        n *= int(v)
    return max(n * tvm.runtime.DataType(str(call.args[3].value)).bits // 8, 1)


def _lifetimes(bindings: list, result) -> dict:
    """Per tensor var of ``alloc_tensor`` in a planned storage: [index of its binding, index
    of the last binding that uses it or anything made from it (``len(bindings)`` when the
    function's ``result`` does)]."""
    owner: dict = {}  # var -> the tensor vars it holds or views
    fields: dict = {}  # var bound to a tuple -> the tensor vars of each of its fields
    life: dict = {}

    def held_by(expr) -> set:
        out = set()
        for u in relax.analysis.free_vars(expr):
            out |= owner.get(u, set())
        return out

    for i, b in enumerate(bindings):
        v = b.value
        if _is_op(v, ALLOC_TENSOR):
            owner[b.var] = {b.var}
            life[b.var] = [i, i]
            continue
        if isinstance(v, relax.TupleGetItem) and isinstance(v.tuple_value, relax.Var) \
                and v.tuple_value in fields:  # one field: its tensors, not the others'
            held = set(fields[v.tuple_value][v.index])
        else:
            held = held_by(v)
            if isinstance(v, relax.Tuple):
                fields[b.var] = [held_by(f) for f in v.fields]
        for t in held:
            life[t][1] = i
        if held:  # a tensor, tuple, view or call result made from them (a kernel's: void)
            owner[b.var] = held
    for u in relax.analysis.free_vars(result):
        for t in owner.get(u, ()):
            life[t][1] = len(bindings)
    return life


def _assign(requests: list) -> tuple[list, list]:
    """Storages for ``requests`` ([(first binding, last binding, bytes)]): the largest tensor
    first, each in the smallest storage already made that holds it and none of whose tensors
    lives while it does, else in a new storage of its size. Returns (storage index per
    request, storage sizes)."""
    sizes: list = []
    spans: list = []  # per storage: the (first, last) of its tensors
    where = [0] * len(requests)
    for i in sorted(range(len(requests)), key=lambda i: (-requests[i][2], requests[i][0])):
        start, end, need = requests[i]
        best = None
        for k, size in enumerate(sizes):
            if size >= need and (best is None or size < sizes[best]) and \
                    all(end < a or start > b for a, b in spans[k]):
                best = k
        if best is None:
            sizes.append(need)
            spans.append([])
            best = len(sizes) - 1
        spans[best].append((start, end))
        where[i] = best
    return where, sizes


def merge_function(func: relax.Function) -> relax.Function:
    """``func`` (right after ``StaticPlanBlockMemory``) with the tensors it planned placed
    again in storages shared across dtypes (module docstring); as it is without a float16
    storage."""
    if not isinstance(func.body, relax.SeqExpr):
        return func
    bindings = [b for block in func.body.blocks for b in block.bindings]
    allocs = {b.var: b.value for b in bindings if _is_op(b.value, ALLOC_STORAGE)}
    if not any(str(c.args[3].value) == "float16" for c in allocs.values()):
        return func
    life = _lifetimes(bindings, func.body.body)
    tensors = [b for b in bindings if _is_op(b.value, ALLOC_TENSOR)
               and isinstance(b.value.args[0], relax.Var) and b.value.args[0] in allocs]
    where, sizes = _assign([(life[b.var][0], life[b.var][1], _tensor_bytes(b.value))
                            for b in tensors])
    storage_of = {b.var: k for b, k in zip(tensors, where)}
    proto = next(iter(allocs.values()))
    svars = [relax.Var(f"storage_m{k}", relax.ObjectType()) for k in range(len(sizes))]
    made, out = set(), []
    for b in bindings:
        if b.var in allocs:
            continue  # the planned storages are made again below
        k = storage_of.get(b.var)
        if k is not None:
            if k not in made:
                made.add(k)
                out.append(relax.VarBinding(svars[k], relax.Call(
                    proto.op, [relax.ShapeExpr([sizes[k]]), *proto.args[1:3],
                               proto.args[3]], proto.attrs, proto.ty_args)))
            c = b.value
            b = relax.VarBinding(b.var, relax.Call(c.op, [svars[k], *c.args[1:]], c.attrs,
                                                   c.ty_args))
        out.append(b)
    body = relax.SeqExpr([relax.BindingBlock(out)], func.body.body)
    return relax.Function(func.params, body, func.ret_ty, func.is_pure, func.attrs)


@tvm.transform.module_pass(opt_level=0, name="ThomasTuneMergeStorages")
def merge_storages(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
    """``mod`` with :func:`merge_function` applied to each Relax function: a pass to run
    right after ``StaticPlanBlockMemory`` (before ``LowerAllocTensor`` gives the tensors it
    did not plan storages of their own)."""
    out = mod.clone() if hasattr(mod, "clone") else tvm.IRModule(mod.functions, attrs=mod.attrs)
    for gv, f in mod.functions.items():
        if isinstance(f, relax.Function):
            new = merge_function(f)
            if new is not f:
                out[gv] = new
    return out
