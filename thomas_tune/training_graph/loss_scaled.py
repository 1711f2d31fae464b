"""The optimizer of a loss-scaled step: gradients unscaled, the update skipped when one is not
finite (:mod:`thomas_tune.loss_scale` says why and how the scale is chosen).

:func:`loss_scaled_function` builds, for a multi-tensor optimizer
(:mod:`thomas_tune.training_graph.optimizers`), the function ``(params, grads, optim_state,
loss_scale) -> (new params, new optim_state, skipped)``: ``inv_scale = 1 / loss_scale``
(float32, as GradScaler's ``unscale_``), then

* ``skipped``: a 0-d float32, how many elements ``g * inv_scale`` of the parameter gradients
  are infinite or NaN (0: the update ran; :func:`nonfinite_kernel`: one sum over the gradients
  of as many parameters as a kernel's arguments allow, the groups' counts added). Finiteness
  is read from the bits (exponent all ones), which no fast-math option folds away; a sum, not
  a maximum, because the GPU build's reductions (``schedules.accumulate``) know a sum's
  identity;
* the optimizer's own multi-tensor update with every gradient ``g`` read as ``g * inv_scale``
  and every new value ``X_new`` written as ``skipped > 0 ? X : X_new`` (:func:`scaled_exprs`),
  the step count advanced by one only where ``skipped`` is 0, Adam's ``beta^t`` kept on a
  skipped step: a skipped step leaves every parameter and every optimizer state as it was (PyTorch's
  ``GradScaler.step`` does not call ``optimizer.step()`` then).

The skip is a select inside the compiled step, not a decision of the host: the step's update is
in place and in the same function as its backward (``graph.add_train_step``), so the gradients
are buffers the step frees; a host that decided would need them returned (the two-call form, a
gradient's bytes more at the peak) and a round trip between backward and update.
"""

from __future__ import annotations

import numpy as np
import tvm
from tvm import relax

from ..kept_ir import kept
from . import multi_tensor as MT

#: the shared scalars the loss-scaled update reads (beside the optimizer's own)
INV_SCALE, SKIP = "inv_scale", "skip"
#: a float32's exponent bits; all ones: infinite or NaN
_EXPONENT = 0x7F800000


def scaled_exprs(exprs: dict[str, str], inputs: tuple[str, ...], dtype: str) -> dict[str, str]:
    """The update ``exprs`` (output -> TVMScript, :func:`multi_tensor.update_kernel`) of a
    loss-scaled step: the gradient ``g`` read as ``g * inv_scale``, each output ``X_new`` the
    input ``X`` where ``skip`` is set (an output naming no input is left as it is)."""
    out = {}
    for name, expr in exprs.items():
        text = MT._substitute(expr, "g", f"(g * {INV_SCALE})")
        old = name[:-len("_new")] if name.endswith("_new") else None
        if old in inputs:
            text = f"T.Select({SKIP} > T.{dtype}(0), {old}, {text})"
        out[name] = text
    return out


def _bad(j: int, offset: int, dtype: str) -> str:
    """TVMScript: 1 where gradient ``j``'s element ``vi - offset``, unscaled, is not finite."""
    v = f"T.reinterpret('uint32', g{j}_[vi - {offset}] * {INV_SCALE}[()])"
    return (f"T.Select(T.bitwise_and({v}, T.uint32({_EXPONENT})) == T.uint32({_EXPONENT}), "
            f"T.{dtype}(1), T.{dtype}(0))")


def _tree(offsets: list[int], lo: int, hi: int, dtype: str) -> str:
    if hi - lo == 1:
        return _bad(lo, offsets[lo], dtype)
    mid = (lo + hi) // 2
    return (f"T.if_then_else(vi < {offsets[mid]}, {_tree(offsets, lo, mid, dtype)}, "
            f"{_tree(offsets, mid, hi, dtype)})")


def nonfinite_kernel(shapes: list[tuple[int, ...]], dtype: str = "float32"
                     ) -> tvm.tirx.PrimFunc:
    """A PrimFunc ``(inv_scale (), g0, g1, ..., found ())``: ``found`` the number of elements of
    the gradients that, times ``inv_scale``, are infinite or NaN; one sum over the
    gradients laid end to end (each element finds its tensor by a binary search over the
    offsets, as :func:`multi_tensor.update_kernel`'s do). Raises ValueError for no shape."""
    if not shapes:
        raise ValueError("nonfinite_kernel: no gradient")
    sizes = [int(np.prod(s)) if len(s) else 1 for s in shapes]
    offsets = np.cumsum([0, *sizes]).tolist()
    total = offsets[-1]
    args = [f"{INV_SCALE}: T.Buffer((), '{dtype}')"] + [
        f"g{j}: T.Buffer({tuple(s)}, '{dtype}')" for j, s in enumerate(shapes)] + [
        f"found: T.Buffer((), '{dtype}')"]
    reads = ", ".join([f"{INV_SCALE}[()]"] + [
        f"g{j}[{', '.join(f'0:{d}' for d in s)}]" if s else f"g{j}[()]"
        for j, s in enumerate(shapes)])
    views = [f"g{j}_ = T.decl_buffer(({sizes[j]},), '{dtype}', data=g{j}.data)"
             for j in range(len(shapes))]
    text = "\n".join([
        "@T.prim_func(s_tir=True)",
        f"def main({', '.join(args)}):",
        "    T.func_attr({'tirx.noalias': True})",
        *("    " + v for v in views),
        f"    for i in range({total}):",
        "        with T.sblock('nonfinite'):",
        f"            vi = T.axis.reduce({total}, i)",
        f"            T.reads({reads})",
        "            T.writes(found[()])",
        "            with T.init():",
        f"                found[()] = T.{dtype}(0)",
        f"            found[()] = found[()] + {_tree(offsets, 0, len(shapes), dtype)}",
        ""])
    return kept("update_kernels", [text], lambda: tvm.script.from_source(text))


def emit_nonfinite(bb: relax.BlockBuilder, grads: list[relax.Expr],
                   shapes: list[tuple[int, ...]], inv_scale: relax.Expr, dtype: str
                   ) -> relax.Expr:
    """Emit the count of :func:`nonfinite_kernel` over all ``grads`` (as many per kernel as its
    arguments allow, :data:`multi_tensor.MAX_BUFFERS`), the groups' counts added: a 0-d
    ``dtype`` value, the unscaled gradient elements that are not finite (0: all are)."""
    size = MT.group_size(1, 2)
    flag = None
    for group in MT.groups(len(shapes), size):
        gv = bb.add_func(nonfinite_kernel([shapes[j] for j in group], dtype), "nonfinite")
        part = bb.emit(relax.call_tir(gv, [inv_scale, *(grads[j] for j in group)],
                                      relax.TensorType((), dtype)))
        flag = part if flag is None else bb.emit(relax.op.add(flag, part))
    return flag


def loss_scaled_function(opt, name: str) -> relax.Function:
    """The loss-scaled form (module docstring) of the multi-tensor optimizer ``opt`` (a
    ``optimizers._MultiTensor``, ``init`` called), under ``name``: ``(params, grads,
    optim_states, loss_scale ()) -> (params_new, optim_states_new, skipped ())``, the same
    state layout as its plain function. Its kernels go to ``opt.kernels``."""
    opt._check_init()
    plist = opt.param_list
    dtype = str(plist[0].ty.dtype)
    scalars, buffers = opt.scalars(), opt.buffers
    param_var = relax.Var("params", relax.TupleType([p.ty for p in plist]))
    grad_var = relax.Var("gradients", relax.TupleType([p.ty for p in plist]))
    state_var = relax.Var("optim_states", relax.TupleType(
        [relax.TensorType((), "int64")] + [relax.TensorType((), dtype) for _ in scalars]
        + [p.ty for _ in buffers for p in plist]))
    scale_var = relax.Var("loss_scale", relax.TensorType((), dtype))
    n, first = len(plist), 1 + len(scalars)
    shapes = [tuple(int(d) for d in p.ty.shape.values) for p in plist]
    inputs = ("p", "g", *buffers)
    bb = relax.BlockBuilder()
    with bb.function(name, [param_var, grad_var, state_var, scale_var]):
        with bb.dataflow():
            steps = bb.emit(relax.TupleGetItem(state_var, 0), "num_steps")
            inv = bb.emit(relax.op.divide(relax.const(1.0, dtype), scale_var), INV_SCALE)
            grads = [bb.emit(relax.TupleGetItem(grad_var, j)) for j in range(n)]
            skip = emit_nonfinite(bb, grads, shapes, inv, dtype)
            old = [bb.emit(relax.TupleGetItem(state_var, 1 + i)) for i in range(len(scalars))]
            shared = {s: bb.emit(relax.op.multiply(o, relax.const(f, dtype)), s)
                      for o, (s, f) in zip(old, scalars.items())}
            tensors = [[bb.emit(relax.TupleGetItem(param_var, j)), grads[j],
                        *(bb.emit(relax.TupleGetItem(state_var, first + b * n + j))
                          for b in range(len(buffers)))] for j in range(n)]
            outs, steps_new = MT.emit_update(
                bb, opt.name + "_update", tensors, shapes, inputs,
                scaled_exprs(opt.exprs(), inputs, dtype), dtype,
                {**shared, INV_SCALE: inv, SKIP: skip}, counter=steps,
                counter_step=f"T.Select({SKIP} > T.{dtype}(0), T.int64(0), T.int64(1))")
            kept = [bb.emit(relax.op.where(relax.op.greater(skip, relax.const(0.0, dtype)),
                                           o, s)) for o, s in zip(old, shared.values())]
            params_out = bb.emit_output(relax.Tuple([o[-1] for o in outs]), "params_new")
            state_out = bb.emit_output(relax.Tuple(
                [steps_new, *kept, *(o[b] for b in range(len(buffers)) for o in outs)]),
                "optim_states_new")
            skipped = bb.emit_output(skip, "skipped")
        bb.emit_func_output((params_out, state_out, skipped))
    built = bb.get()
    opt.kernels = {gv: f for gv, f in built.functions.items()
                   if isinstance(f, tvm.tirx.PrimFunc)}
    return built[name]
