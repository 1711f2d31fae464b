"""Multi-tensor optimizer kernels: the update of many parameters in one kernel launch.

An optimizer step written per parameter launches one kernel per trainable tensor (158 for
MobileNetV2), each too small to fill a GPU, and on a phone each launch costs more than the
arithmetic it runs. Here one kernel updates a group of parameters: its one loop runs over the
elements of all of them, flattened and laid end to end, and each element finds its tensor by a
binary search over the group's offsets (``if i < offset`` nested ``log2(group)`` deep; the
neighbouring work-items of a GPU take the same branch except at a boundary).

A group holds as many parameters as a kernel's arguments allow on every OpenCL device: the
OpenCL 3.0 specification (``clGetDeviceInfo``, ``CL_DEVICE_MAX_PARAMETER_SIZE``) guarantees
1,024 bytes of kernel arguments on a full-profile device, :data:`MAX_BUFFERS` buffers of 8
bytes. The update is in place (each new value written over the old, see
:func:`update_kernel`), and the first kernel also advances the step count (one more buffer),
so momentum SGD passes 3 buffers per parameter (p, g, v): 42 parameters a kernel; SGD 2: 63;
Adam 4 and two shared scalars: 31.

:func:`emit_update` emits the calls of a graph's update as such kernels. The kernel is
written in TVMScript (an ``s_tir`` block over the flattened elements, each tensor read and
written through a flat view of its data); the default GPU schedules bind its loop to
work-groups, and on a CPU it is a plain loop.
"""

from __future__ import annotations

from decimal import Decimal

import numpy as np
import tvm
from tvm import relax

from ..kept_ir import kept

MAX_BUFFERS = 128  # buffer arguments of one kernel: OpenCL's 1,024 bytes of arguments / 8


def group_size(per_tensor: int, shared: int = 0) -> int:
    """Parameters one kernel updates when each takes ``per_tensor`` buffers and the kernel
    ``shared`` more (:data:`MAX_BUFFERS` in all). Raises ValueError when not even one fits."""
    size = (MAX_BUFFERS - shared) // max(per_tensor, 1)
    if size < 1:
        raise ValueError(f"a multi-tensor kernel of {per_tensor} buffers per tensor and "
                         f"{shared} shared ones exceeds {MAX_BUFFERS} arguments")
    return size


def groups(n: int, size: int) -> list[range]:
    """Indices 0..n-1 in consecutive groups of at most ``size``, as even as possible."""
    k = max(1, -(-n // size))
    bounds = np.linspace(0, n, k + 1).round().astype(int)
    return [range(int(a), int(b)) for a, b in zip(bounds[:-1], bounds[1:]) if b > a]


def _f(value: float, dtype: str) -> str:
    return f"T.{dtype}({float(value)!r})"


def update_kernel(shapes: list[tuple[int, ...]], inputs: tuple[str, ...],
                  outputs: dict[str, str], dtype: str = "float32",
                  shared: tuple[str, ...] = (), inplace: bool = False,
                  counter: str | None = None,
                  counter_step: str = "T.int64(1)") -> tvm.tirx.PrimFunc:
    """A PrimFunc updating len(shapes) tensors in one loop.

    Its arguments are one 0-d buffer per name of ``shared`` (scalars every tensor's update
    reads, e.g. Adam's bias corrections), then, per tensor ``j`` in order, one buffer per
    name of ``inputs``; then, per
    tensor in order, one per key of ``outputs`` (all of shape ``shapes[j]`` and ``dtype``), as
    ``call_tir`` passes them. ``outputs`` maps
    each output's name to its expression: TVMScript over the inputs' names (each stands for
    the element being updated) and the outputs before it, e.g. ``{"v_new": "0.9 * v + g",
    "p_new": "p - 0.01 * v_new"}``; numbers in it are written as ``T.float32(...)`` by the
    caller. Each element's new values are all computed (bound to locals) before any is stored.

    ``inplace``: every output ``X_new`` is written over its input ``X`` (the parameter and its
    optimizer state updated where they are, as ``relax.call_tir_inplace`` runs it): the
    kernel's arguments are then the shared scalars and the inputs only, and since nothing is
    stored before every value is computed, no expression reads a value already overwritten.
    ``counter`` (with ``inplace``): the name of a 0-d int64 argument, placed after the shared
    scalars, that the kernel adds one to (the optimizer's step count: no launch of its own);
    ``counter_step``: what it adds instead, TVMScript over the shared scalars (a loss-scaled
    step adds one only when it updates, :mod:`thomas_tune.training_graph.loss_scaled`).
    Raises ValueError for an empty list of shapes, for a ``counter`` without ``inplace``, and
    with ``inplace`` for an output whose name is not an input's with ``_new`` appended."""
    over = _in_place_outputs(shapes, inputs, outputs, inplace, counter)
    sizes = [int(np.prod(s)) if len(s) else 1 for s in shapes]
    offsets = np.cumsum([0, *sizes]).tolist()
    total = offsets[-1]
    stored = tuple(o for o in outputs if o not in over)  # outputs with buffers of their own
    layout = _Layout(shapes, sizes, dtype, inputs, outputs, over, shared, counter)
    views = [f"{name}{j}_ = T.decl_buffer(({sizes[j]},), '{dtype}', data={name}{j}.data)"
             for j in range(len(shapes)) for name in (*inputs, *stored)]
    body: list[str] = []
    if counter:  # one work-item counts the step
        body.append(f"{' ' * 12}if vi == 0:")
        step = counter_step
        for name in shared:
            step = _substitute(step, name, f"{name}[()]")
        body.append(f"{' ' * 16}{counter}_w[0] = {counter}[()] + {step}")
    _chain(layout, offsets, body, 0, len(shapes), " " * 12)
    text = "\n".join([
        "@T.prim_func(s_tir=True)",
        f"def main({', '.join(layout.arguments(stored))}):",
        "    T.func_attr({'tirx.noalias': True})",
        *("    " + w for w in layout.written()),
        f"    for i in range({total}):",
        "        with T.sblock('update'):",
        f"            vi = T.axis.spatial({total}, i)",
        f"            T.reads({layout.reads()})",
        f"            T.writes({layout.writes()})",
        *("            " + v for v in views),
        *body, ""])
    return kept("update_kernels", [text], lambda: tvm.script.from_source(text))


def _in_place_outputs(shapes, inputs, outputs, inplace, counter) -> dict[str, str]:
    """:func:`update_kernel`'s arguments checked: the in-place outputs, each ``X_new`` mapped
    to the input ``X`` it overwrites (empty unless ``inplace``). Raises ValueError as
    :func:`update_kernel` says."""
    if not shapes:
        raise ValueError("update_kernel: no tensor to update")
    if counter and not inplace:
        raise ValueError("update_kernel: a step counter is updated in place only (inplace=True)")
    over = {out: out[:-len("_new")] for out in outputs} if inplace else {}
    bad = [out for out, name in over.items() if not out.endswith("_new") or name not in inputs]
    if bad:
        raise ValueError(f"update_kernel: in-place outputs {bad} name no input (an output "
                         f"X_new overwrites the input X; inputs {list(inputs)})")
    return over


class _Layout:
    """The buffers of one :func:`update_kernel`: per tensor ``j`` of ``shapes`` (elements
    ``sizes[j]``) a buffer per input and per stored output, named ``<name><j>``; the shared
    scalars; the step counter; the in-place outputs ``over`` (output -> the input it
    overwrites), written through a second flat view ``<input><j>_w``. Its methods give the
    TVMScript text of the kernel's arguments, its flat write views and its block's read and
    write regions."""

    def __init__(self, shapes, sizes, dtype, inputs, outputs, over, shared, counter):
        self.shapes, self.sizes, self.dtype = shapes, sizes, dtype
        self.inputs, self.outputs, self.over = inputs, outputs, over
        self.shared, self.counter = shared, counter

    def region(self, name: str, j: int) -> str:
        shape = self.shapes[j]
        return f"{name}{j}[{', '.join(f'0:{d}' for d in shape)}]" if shape else f"{name}{j}[()]"

    def arguments(self, stored: tuple[str, ...]) -> list[str]:
        """call_tir's order: the shared scalars, the counter, every input, then every output."""
        def arg(name, j):
            return f"{name}{j}: T.Buffer({tuple(self.shapes[j])}, '{self.dtype}')"
        n = range(len(self.shapes))
        return ([f"{name}: T.Buffer((), '{self.dtype}')" for name in self.shared]
                + ([f"{self.counter}: T.Buffer((), 'int64')"] if self.counter else [])
                + [arg(name, j) for j in n for name in self.inputs]
                + [arg(name, j) for j in n for name in stored])

    def written(self) -> list[str]:
        """The flat views an overwritten input (and the counter) is written through, declared
        before the loop: a block that reads and writes one buffer has no GPU schedule in
        dlight (each element is read before it is written, by the same iteration, so this is
        exact)."""
        out = [f"{self.over[n]}{j}_w = T.decl_buffer(({self.sizes[j]},), '{self.dtype}', "
               f"data={self.over[n]}{j}.data)" for j in range(len(self.shapes))
               for n in self.outputs if n in self.over]
        if self.counter:
            out.append(f"{self.counter}_w = T.decl_buffer((1,), 'int64', "
                       f"data={self.counter}.data)")
        return out

    def reads(self) -> str:
        return ", ".join([f"{name}[()]" for name in self.shared]
                         + ([f"{self.counter}[()]"] if self.counter else [])
                         + [self.region(n, j) for j in range(len(self.shapes))
                            for n in self.inputs])

    def writes(self) -> str:
        return ", ".join(([f"{self.counter}_w[0:1]"] if self.counter else [])
                         + [f"{self.over[n]}{j}_w[0:{self.sizes[j]}]" if n in self.over
                            else self.region(n, j)
                            for j in range(len(self.shapes)) for n in self.outputs])


def _leaf(layout: _Layout, offsets: list[int], body: list[str], j: int, indent: str) -> None:
    """Tensor ``j``'s update as lines of ``body``: every new value bound first, then stored."""
    i = f"vi - {offsets[j]}"
    env = {name: f"{name}{j}_[{i}]" for name in layout.inputs}
    env.update({name: f"{name}[()]" for name in layout.shared})
    for out, expr in layout.outputs.items():
        text = expr
        for name in sorted(env, key=len, reverse=True):
            text = _substitute(text, name, env[name])
        body.append(f"{indent}{out}_{j}: T.{layout.dtype} = {text}")  # (buffer {out}{j})
        env[out] = f"{out}_{j}"
    body.extend(f"{indent}{layout.over[out]}{j}_w[{i}] = {out}_{j}" if out in layout.over
                else f"{indent}{out}{j}_[{i}] = {out}_{j}" for out in layout.outputs)


def _chain(layout: _Layout, offsets: list[int], body: list[str], lo: int, hi: int,
           indent: str) -> None:
    """Tensors ``lo`` to ``hi`` as a binary tree of ``if vi < offset`` over their flat
    ranges, each leaf :func:`_leaf`."""
    if hi - lo == 1:
        _leaf(layout, offsets, body, lo, indent)
        return
    mid = (lo + hi) // 2
    body.append(f"{indent}if vi < {offsets[mid]}:")
    _chain(layout, offsets, body, lo, mid, indent + "    ")
    body.append(f"{indent}else:")
    _chain(layout, offsets, body, mid, hi, indent + "    ")


def emit_update(bb: relax.BlockBuilder, name: str, tensors: list[list[relax.Expr]],
                       shapes: list[tuple[int, ...]], inputs: tuple[str, ...],
                       outputs: dict[str, str], dtype: str,
                       shared: dict[str, relax.Expr] | None = None,
                       inplace: bool = True, counter: relax.Expr | None = None,
                       counter_step: str = "T.int64(1)"
                       ) -> tuple[list[list[relax.Expr]], relax.Expr | None]:
    """Emit the update of every parameter as multi-tensor kernels
    (:func:`update_kernel`, as many parameters per kernel as its
    arguments allow). ``tensors[j]``: parameter j's inputs in the order of ``inputs``;
    ``shared``: 0-d tensors every update reads, by name. With ``inplace`` each output ``X_new``
    overwrites its input ``X`` (``call_tir_inplace``): a step holds one copy of the parameters
    and of the optimizer state, not an old and a new one (the caller drops the old handles,
    which are the new ones); ``counter`` (0-d int64, with ``inplace``), the optimizer's step
    count, is advanced by the first kernel. Returns, per parameter, its outputs in the order
    of ``outputs``, and the advanced counter (None without one)."""
    shared = shared or {}
    size = group_size(len(inputs) + (0 if inplace else len(outputs)),
                         len(shared) + (counter is not None))
    results: list[list[relax.Expr]] = []
    advanced = None
    for group in groups(len(shapes), size):
        count = counter if counter is not None and advanced is None else None
        kernel = update_kernel([shapes[j] for j in group], inputs, outputs, dtype,
                                  tuple(shared), inplace=inplace,
                                  counter="steps" if count is not None else None,
                                  counter_step=counter_step)
        gv = bb.add_func(kernel, name)
        head = [*shared.values(), *([count] if count is not None else [])]
        args = [*head, *(t for j in group for t in tensors[j])]
        out_types = [relax.TensorType(shapes[j], dtype) for j in group for _ in outputs]
        if inplace:
            where = [len(head) + i * len(inputs) + inputs.index(o[:-len("_new")])
                     for i, _ in enumerate(group) for o in outputs]
            if count is not None:
                out_types, where = [relax.TensorType((), "int64"), *out_types], [
                    len(shared), *where]
            call = bb.emit(relax.call_tir_inplace(gv, args, where, out_types))
        else:
            call = bb.emit(relax.call_tir(gv, args, out_types))
        first = 0
        if count is not None:
            advanced, first = bb.emit(relax.TupleGetItem(call, 0)), 1
        k = len(outputs)
        for i, _ in enumerate(group):
            results.append([bb.emit(relax.TupleGetItem(call, first + i * k + o))
                            for o in range(k)])
    return results, advanced


def _substitute(text: str, name: str, value: str) -> str:
    """``text`` with the identifier ``name`` (whole word) replaced by ``value``."""
    import re
    return re.sub(rf"(?<![\w.]){re.escape(name)}(?!\w)", value, text)


def momentum_sgd_exprs(lr: float, momentum: float, weight_decay: float,
                       dtype: str = "float32") -> dict[str, str]:
    """The outputs of one momentum-SGD update (PyTorch's SGD with ``momentum``, no
    dampening): ``v_new = momentum * v + g + weight_decay * p``, ``p_new = p - lr * v_new``."""
    grad = f"g + {_f(weight_decay, dtype)} * p" if weight_decay else "g"
    return {"v_new": f"{_f(momentum, dtype)} * v + ({grad})",
            "p_new": f"p - {_f(lr, dtype)} * v_new"}


def sgd_exprs(lr: float, weight_decay: float, dtype: str = "float32") -> dict[str, str]:
    """The output of one plain SGD update: ``p_new = p - lr * (g + weight_decay * p)``."""
    grad = f"g + {_f(weight_decay, dtype)} * p" if weight_decay else "g"
    return {"p_new": f"p - {_f(lr, dtype)} * ({grad})"}


def adam_exprs(lr: float, beta1: float, beta2: float, eps: float, weight_decay: float,
               dtype: str = "float32") -> dict[str, str]:
    """The outputs of one Adam update (Kingma & Ba 2015, Algorithm 1, as
    ``relax.training.optimizer.Adam`` computes it): with ``g' = g + weight_decay * p``,
    ``m_new = beta1 * m + (1 - beta1) * g'``, ``v_new = beta2 * v + (1 - beta2) * g'^2``,
    ``p_new = p - lr * (m_new / (1 - b1t)) / (sqrt(v_new / (1 - b2t)) + eps)``; ``b1t`` and
    ``b2t`` (beta^t of this step) are the kernel's shared scalars."""
    def f(v):
        return _f(v, dtype)

    def one_minus(b):  # as relax.training does: 1 - 0.999 is 0.001, not 0.0010000000000000009
        return float(Decimal("1") - Decimal(str(b)))

    grad = f"(g + {f(weight_decay)} * p)" if weight_decay else "g"
    return {"m_new": f"{f(beta1)} * m + {f(one_minus(beta1))} * {grad}",
            "v_new": f"{f(beta2)} * v + {f(one_minus(beta2))} * ({grad} * {grad})",
            "p_new": f"p - {f(lr)} * ((m_new / ({f(1.0)} - b1t)) / "
                     f"(T.sqrt(v_new / ({f(1.0)} - b2t)) + {f(eps)}))"}
