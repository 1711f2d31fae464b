"""The frozen parameters' transforms computed once, not at every training step.

A step function reads the frozen parameters as ordinary inputs, so whatever the graph computes
from them alone runs again at every step although its result never changes: the Winograd form's
weight transform of each frozen convolution (``winograd_form``: ``G g G^T`` per output and input
channel, a launch and the weights' bytes read and written), the fold of a frozen BatchNorm into
its convolution (``models.batchnorm.bn_fold``), a bias's reshape. Relax's
``LiftTransformParams`` moves every binding that depends on marked parameters only into a
function of its own; here that function is run once when the parameters are loaded
(``runtime.Session``) and the step takes its outputs. It runs on the fused module, so only
whole kernels that read constants alone move: a kernel that reads a constant beside the
activations (a bias in a convolution's epilogue) keeps its workload and its tuning records.

:data:`ATTR` on a Relax function asks for it: ``[first, count, extra...]``, the positions of
the frozen parameters among the function's parameters (``first``, then ``count`` of them), and
of other inputs that are constant too but stay in their places (the running statistics of
BatchNorms in inference form, which the step also returns as they are).
:func:`lift_frozen` (which ``tasks.fuse`` applies last, after the Winograd rewrite and the
fusion) then leaves two functions:

* ``NAME`` itself, its frozen parameters replaced in place (from ``first`` on) by its frozen
  slots (:data:`SLOTS`; :func:`thomas_tune.tasks.lifted_slots` reads them from a build): a
  frozen parameter the step reads as it is takes that parameter, every other slot the next
  output of ``NAME_frozen``; the extra inputs in their places; the other parameters
  unchanged;
* ``NAME_frozen`` (:func:`thomas_tune.manifest.frozen_function`): ``(frozen parameters...,
  extra inputs...) -> tuple of the lifted values`` (each a tensor of its own), in their order
  in ``NAME``.
"""

from __future__ import annotations

import tvm
from tvm import relax, te

from ..manifest import frozen_function

ATTR = "thomas_tune.lift_frozen"
#: on the split step function: per frozen slot, the frozen parameter it takes as it is, or ""
#: for the next output of ``NAME_frozen``
SLOTS = "thomas_tune.frozen_slots"


def lift_frozen(mod: tvm.IRModule) -> tvm.IRModule:
    """``mod`` with each Relax function that carries :data:`ATTR` split in two (module
    docstring); the others unchanged. Raises ValueError when the attribute's positions are not
    among the function's parameters."""
    todo = [gv for gv, f in mod.functions.items()
            if isinstance(f, relax.Function) and f.attrs and ATTR in f.attrs]
    for gv in todo:
        mod = _lift_one(mod, gv.name_hint)
    return mod


@relax.expr_functor.mutator
class _Substitute(relax.PyExprMutator):
    """Replaces variables by others (``table``: old -> new)."""

    def __init__(self, table: dict):
        super().__init__()
        self.table = table

    def visit_var_(self, op):
        return next((new for old, new in self.table.items() if old.same_as(op)), op)


def _copy(a: te.Tensor) -> te.Tensor:
    return te.compute(a.shape, lambda *i: a(*i), name="frozen_copy")


def _bindings(func: relax.Function) -> dict:
    out = {}
    for block in func.body.blocks:
        for b in block.bindings:
            out[b.var] = b.value
    return out


def _kind(mod: tvm.IRModule, expr, bindings: dict, tuple_param):
    """What the transform's output ``expr`` is: ``("param", j)`` for the j-th frozen
    parameter as it is, ``("kernel", None)`` for a kernel's output, ``("view", None)`` for
    anything else (a reshape: a view of a parameter once built). ``mod`` holds the kernels."""
    while isinstance(expr, relax.Var) and expr in bindings:
        expr = bindings[expr]
    if isinstance(expr, relax.TupleGetItem) and expr.tuple_value.same_as(tuple_param):
        return "param", int(expr.index)
    if isinstance(expr, relax.Call) and expr.op.same_as(tvm.ir.Op.get("relax.call_tir")):
        # a kernel that only reshapes becomes a view of its input in the build
        # (RewriteDataflowReshape)
        reshape = relax.analysis.has_reshape_pattern(mod[expr.args[0]])
        return ("view", None) if reshape else ("kernel", None)
    return "view", None


def _lift_one(mod: tvm.IRModule, name: str) -> tvm.IRModule:
    """``mod`` with its function ``name`` split at the parameters :data:`ATTR` marks (module
    docstring): the function, taking its frozen slots (:data:`SLOTS`) in the first marked
    parameter's place, and ``NAME_frozen`` (:func:`frozen_function`), which computes the
    lifted values from the marked parameters. Raises ValueError for marked positions that are
    not among its parameters, or a lifted transform that returns no tuple of the values."""
    f = mod[name]
    first, count, *extra = (int(v) for v in f.attrs[ATTR])
    params = list(f.params)
    marked = list(range(first, first + count)) + extra
    if first < 0 or count < 1 or len(set(marked)) != len(marked) or \
            not all(0 <= i < len(params) for i in marked):
        raise ValueError(f"{name}: frozen parameters at {first}..{first + count - 1} (and "
                         f"{extra}) are not among its {len(params)} parameters")
    kept = [i for i in range(len(params)) if i not in set(marked)]
    # LiftTransformParams takes the function's first num_input parameters as its inputs and
    # the rest as parameters whose transforms it lifts: the marked ones go last
    staged = relax.Function([params[i] for i in kept] + [params[i] for i in marked], f.body,
                            f.ret_ty, f.is_pure,
                            f.attrs).without_attr(ATTR).with_attr("num_input", len(kept))
    mod = tvm.IRModule(dict(mod.functions), attrs=mod.attrs)
    mod[name] = staged
    with tvm.transform.PassContext(opt_level=3):
        mod = relax.transform.LiftTransformParams()(mod)
    lifted = mod[name]
    lp = list(lifted.params)
    transform = mod.get_global_var(f"{name}_transform_params")
    tfunc = mod[transform]
    bindings = _bindings(tfunc)
    fields = _lifted_values(name, tfunc, bindings, len(marked), len(lp) - len(kept))
    kinds = [_kind(mod, e, bindings, tfunc.params[0]) for e in fields]
    values = lp[len(kept):]
    # each kept parameter, and each extra one that the function reads as it is, in its own
    # place; in the frozen parameters' place the frozen slots: a frozen parameter read as it
    # is takes the parameter itself (no copy, and no tensor that outlives the call it came in
    # through: over RPC a call's arguments are borrowed), every other lifted value is an
    # output of NAME_frozen (a view copied there into a tensor of its own)
    own = {marked[j]: values[i] for i, (k, j) in enumerate(kinds)
           if k == "param" and marked[j] in extra}
    slots = [(values[i], str(params[marked[j]].name) if k == "param" else "")
             for i, (k, j) in enumerate(kinds) if not (k == "param" and marked[j] in extra)]
    # a marked parameter that the function still reads outside what was lifted (a state it
    # returns as it is, outside its dataflow block) stays a parameter of it
    free = relax.analysis.free_vars(relax.Function(lp, lifted.body, lifted.ret_ty))
    read = {i for i in marked if any(v.same_as(params[i]) for v in free)}
    slots += [(params[i], str(params[i].name)) for i in range(first, first + count)
              if i in read]
    body = lifted.body
    both = {own[i]: params[i] for i in read if i in own}
    if both:  # read as it is in both places: one parameter
        body = _Substitute(both).visit_expr(body)
    new_params = []
    for i, p in enumerate(params):
        if i in kept:
            new_params.append(lp[kept.index(i)])
        elif i == first:
            new_params += [v for v, _ in slots]
        elif i in extra:  # read as it is, or a parameter the function ignores
            new_params.append(params[i] if i in read else own.get(i, relax.Var(p.name, p.ty)))
    mod[name] = relax.Function(new_params, body, lifted.ret_ty, lifted.is_pure,
                               lifted.attrs).without_attr("num_input").with_attr(
        SLOTS, [n for _, n in slots])
    return _with_frozen_function(mod, name, transform, [params[i] for i in marked], kinds)


def _lifted_values(name: str, tfunc: relax.Function, bindings: dict, n_marked: int,
                   n_lifted: int) -> list:
    """The expressions of the ``n_lifted`` values that the lifted transform ``tfunc`` returns
    (its tuple's fields, or each of its ``n_marked`` inputs where it computes nothing).
    Raises ValueError when it returns anything else."""
    result = tfunc.body.body
    while isinstance(result, relax.Var) and result in bindings:
        result = bindings[result]
    if result.same_as(tfunc.params[0]):  # nothing computed: every value as it came in
        fields = [relax.TupleGetItem(result, j) for j in range(n_marked)]
    else:
        fields = list(result.fields) if isinstance(result, relax.Tuple) else None
    if fields is None or len(fields) != n_lifted:
        raise ValueError(f"{name}: the lifted transform returns "
                         f"{len(fields) if fields is not None else type(result).__name__}, "
                         f"not one tuple of the {n_lifted} lifted values")
    return fields


def _with_frozen_function(mod: tvm.IRModule, name: str, transform, marked: list,
                          kinds: list) -> tvm.IRModule:
    """``mod`` with ``NAME_frozen`` (:func:`frozen_function`) added: from the ``marked``
    parameters, the lifted values (``transform``'s outputs) that are not a parameter read as
    it is (``kinds``, :func:`_kind`), each view copied into a tensor of its own."""
    flat = [relax.Var(p.name, p.ty) for p in marked]
    bb = relax.BlockBuilder(mod)
    with bb.function(frozen_function(name), flat):
        out = bb.emit(relax.Call(transform, [relax.Tuple(flat)]))
        outputs = []
        for i, (k, _) in enumerate(kinds):
            if k == "param":
                continue
            v = bb.emit(relax.TupleGetItem(out, i))
            if k == "view":  # a kernel of its own (lifting runs after legalization)
                v = bb.emit_te(_copy, v, primfunc_name_hint="frozen_copy")
            outputs.append(v)
        bb.emit_func_output(relax.Tuple(outputs))
    return bb.get()
