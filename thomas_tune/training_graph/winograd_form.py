"""Winograd convolutions: a stride-1 convolution as transforms around a batched matmul.

A convolution of an ``r x r`` filter computing ``m x m`` outputs at a time, F(m x m, r x r),
reads an ``alpha x alpha`` input tile (``alpha = m + r - 1``) and needs ``alpha^2`` multiplies
per tile and channel pair where the direct form needs ``m^2 r^2`` (Lavin and Gray 2015, "Fast
Algorithms for Convolutional Neural Networks", arXiv:1509.09308):

    Y = A^T [ (G g G^T) . (B^T d B) ] A

for a filter ``g`` (r x r) and input tile ``d`` (alpha x alpha). Summed over the input
channels, the element-wise products become ``alpha^2`` independent matmuls, one per tile
position. F(2x2, 3x3) needs 16 multiplies for 4 outputs (36 direct, 2.25x fewer); F(2x2, 5x5)
36 for 4 (100, 2.78x fewer).

The training step computes this form in four kernels per convolution (each a task of its own):

- ``winograd_weight``: ``U[e, u, i, o] = sum G[e, a] G[u, b] w[o, i, a, b]`` (alpha x alpha x
  C_in x C_out); trainable filters change every step, so this runs every step (C_in x C_out x
  alpha^2 values, small beside the rest); a frozen convolution's runs once per load
  (``thomas_tune.training_graph.lift``);
- ``winograd_input``: ``V[e, u, i, p] = sum B^T[e, a] B^T[u, b] x[n, i, tile rows, tile cols]``
  for each of the ``P = N x ceil(H/m) x ceil(W/m)`` tiles ``p`` (padding inlined);
- ``winograd_matmul``: ``M[e, u, o, p] = sum_i U[e, u, i, o] V[e, u, i, p]``, the
  ``alpha^2`` matmuls, where the time goes and where tuning pays;
- ``winograd_output``: ``y[n, o, h, w] = sum A^T[h mod m, a] A^T[w mod m, b] M[a, b, o,
  p(n, h, w)]``, which the graph's fusion may join with what follows (a bias, a ReLU mask).

The transposed convolution of a data gradient at stride 1 is the convolution of the output
gradient with the filter flipped and its two channel axes swapped, padded by ``r - 1 - p``:
:func:`rewrite` takes those too, so both the forward pass and the data gradient of a stride-1
layer may use this form. The matrices come from the Toom-Cook construction over the points
0, 1, -1, 2, -2 and infinity (:func:`transform_matrices`), computed exactly in rationals.

In float32 the result differs from the direct form by rounding, which grows with the
transforms' entries: at most 1 in magnitude for F(2x2, 3x3), at most 5 for F(2x2, 5x5). On
PoCL a 3x3 layer agreed with the direct form to 2.6e-7 of its largest output, a 5x5 layer to
1.6e-6. A training step takes the form for the data gradients of 3x3 layers only
(:data:`GRADIENT_FILTERS`); forward passes take it for both sizes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction

import numpy as np
import tvm
from tvm import relax, te, tirx

#: the interpolation points of the Toom-Cook construction, in the order they are used; the
#: last of the ``alpha`` points is always infinity
POINTS = (Fraction(0), Fraction(1), Fraction(-1), Fraction(2), Fraction(-2), Fraction(1, 2),
          Fraction(-1, 2))
#: filter sizes -> output tile size m of F(m x m, r x r)
TILE = {3: 2, 5: 2}
#: filter sizes whose data gradients a training step may compute in this form. F(2x2, 5x5)'s
#: rounding reaches every gradient below the layer: AlexNet@224's second layer's data gradient
#: in this form, in float32 with the rest of the step in float64, puts the first layer's bias
#: gradient 2.0e-6 to 2.8e-6 (of its largest value) from float64 on the step check's three
#: batches, against 1.3e-7 to 1.8e-7 for the direct form in float32 and 8.5e-7 for PyTorch's
#: whole float32 step: over the step check's 3x (docs/journal/precision.md).
GRADIENT_FILTERS = (3,)
#: kernel names (the PrimFuncs' name hints)
KERNELS = ("winograd_weight", "winograd_input", "winograd_matmul", "winograd_output")


def _solve(rows: list[list[Fraction]], rhs: list[Fraction]) -> list[Fraction]:
    """A solution x of ``rows @ x == rhs`` (exact; more equations than unknowns allowed).
    Raises ValueError when the system has no solution."""
    n = len(rows[0])
    a = [list(r) + [b] for r, b in zip(rows, rhs)]
    pivots, row = [], 0
    for col in range(n):
        pick = next((i for i in range(row, len(a)) if a[i][col] != 0), None)
        if pick is None:
            continue
        a[row], a[pick] = a[pick], a[row]
        lead = a[row][col]
        a[row] = [v / lead for v in a[row]]
        for i in range(len(a)):
            if i != row and a[i][col] != 0:
                f = a[i][col]
                a[i] = [v - f * w for v, w in zip(a[i], a[row])]
        pivots.append(col)
        row += 1
    if any(all(v == 0 for v in r[:n]) and r[n] != 0 for r in a):
        raise ValueError("no Winograd transform for these points")
    x = [Fraction(0)] * n
    for i, col in enumerate(pivots):
        x[col] = a[i][n]
    return x


def exact_matrices(m: int, r: int) -> tuple[list, list, list]:
    """(A^T, G, B^T) of F(m, r) as lists of rows of ``Fraction`` (see
    :func:`transform_matrices`). Raises ValueError for m < 1, r < 1 or alpha > 8."""
    alpha = m + r - 1
    if m < 1 or r < 1 or alpha - 1 > len(POINTS):
        raise ValueError(f"F({m}, {r}): need m, r >= 1 and m + r - 2 <= {len(POINTS)}")
    pts = POINTS[:alpha - 1]
    at = [[p ** i for p in pts] + [Fraction(int(i == m - 1))] for i in range(m)]
    g = []
    for j, p in enumerate(pts):
        denom = math.prod((p - q for k, q in enumerate(pts) if k != j), start=Fraction(1))
        g.append([p ** k / denom for k in range(r)])
    g.append([Fraction(int(k == r - 1)) for k in range(r)])
    # B^T column by column: sum_j A^T[i, j] G[j, k] B^T[j, l] == [l == i + k]
    rows = [[at[i][j] * g[j][k] for j in range(alpha)] for i in range(m) for k in range(r)]
    bt_cols = [_solve(rows, [Fraction(int(c == i + k)) for i in range(m) for k in range(r)])
               for c in range(alpha)]
    bt = [[bt_cols[c][j] for c in range(alpha)] for j in range(alpha)]
    for j in range(alpha):  # a row's sign moves between G and B^T: B^T's lead entry positive
        lead = next(v for v in bt[j] if v != 0)
        if lead < 0:
            bt[j] = [-v for v in bt[j]]
            g[j] = [-v for v in g[j]]
    return at, g, bt


def transform_matrices(m: int, r: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(A^T, G, B^T) of F(m, r) as float64 arrays of shapes (m, alpha), (alpha, r) and
    (alpha, alpha), alpha = m + r - 1, such that for every input d (alpha) and filter g (r)
    ``A^T @ ((G @ g) * (B^T @ d))[i] == sum_k d[i + k] g[k]`` (a correlation, as a
    convolution layer computes).

    Toom-Cook over the finite points of :data:`POINTS` and infinity (the construction Lavin
    and Gray 2015 use): A^T holds the points' powers, G the filter polynomial's values at the
    points divided by the Lagrange denominators; B^T is then solved for exactly (in
    rationals), and a row's sign moved between G and B^T so that B^T's rows lead with a
    positive entry. Raises ValueError for m < 1, r < 1 or alpha > 8."""
    return tuple(np.array([[float(v) for v in row] for row in mat])
                 for mat in exact_matrices(m, r))


#: the block annotation that sends a transform to its schedule (``schedules/winograd.py``,
#: registered as a MetaSchedule custom rule and a default GPU rule), and the one that gives it
#: the tile size m
RULE = "schedule_rule"
TILE_ANNOTATION = "winograd_m"


def _combine(coeffs, values, dtype: str):
    """sum of c * v over the nonzero coefficients (1 and -1 without a multiply)."""
    out = None
    for c, v in zip(coeffs, values):
        if c == 0:
            continue
        term = v if abs(c) == 1 else tirx.const(float(abs(c)), dtype) * v
        if out is None:
            out = term if c > 0 else tirx.const(0.0, dtype) - term
        else:
            out = out + term if c > 0 else out - term
    return out if out is not None else tirx.const(0.0, dtype)


def _integer_rows(mat) -> tuple[list[list], list[Fraction]]:
    """Rows of Fractions as rows times a scale each, ``mat[j] == rows[j] * scale[j]``: a row
    whose entries all print exactly (integers, halves, quarters... down to 1/64) stays as it
    is with scale 1; any other row becomes integers times its scale."""
    rows, scales = [], []
    for row in mat:
        if all(v.denominator & (v.denominator - 1) == 0 and v.denominator <= 64 for v in row):
            rows.append(list(row))
            scales.append(Fraction(1))
            continue
        den = math.lcm(*(v.denominator for v in row))
        num = math.gcd(*(int(v * den) for v in row)) or 1
        scale = Fraction(num, den)
        rows.append([v / scale for v in row])
        scales.append(scale)
    return rows, scales


def _scaled(expr, scale: Fraction, dtype: str):
    """``expr * scale`` with exact constants: TVM prints a floating constant with 7
    significant digits, so 1/6 would carry an error of 2e-7 into every value; an integer
    factor or divisor (or a power of two) prints exactly."""
    if scale == 1:
        return expr
    if scale.numerator != 1:
        expr = expr * tirx.const(float(scale.numerator), dtype)
    q = scale.denominator
    if q == 1:
        return expr
    if q & (q - 1) == 0:  # a power of two: its reciprocal is exact
        return expr * tirx.const(1.0 / q, dtype)
    return expr / tirx.const(float(q), dtype)


def _transform(mat, row, col, value, dtype: str):
    """``sum_b mat[col, b] * sum_a mat[row, a] * value(a, b)`` for symbolic ``row`` and
    ``col`` (``mat``: rows of Fractions): a select between sums with integer coefficients,
    one per (row, col), each with only its nonzero terms and then its rows' two scales.
    Once a schedule unrolls the loops of ``row`` and ``col`` the selects fold away, and the
    inner sums of one row are the same expression for every column (the compiler computes
    them once)."""
    ints, scales = _integer_rows(mat)
    rows, k = len(mat), len(mat[0])

    def leaf(r0, c0):
        inner = [_combine(ints[r0], [value(a, b) for a in range(k)], dtype) for b in range(k)]
        return _scaled(_combine(ints[c0], inner, dtype), scales[r0] * scales[c0], dtype)

    def pick(index, options):
        out = options[-1]
        for i in range(len(options) - 2, -1, -1):
            out = tirx.Select(index == i, options[i], out)
        return out

    return pick(row, [pick(col, [leaf(r0, c0) for c0 in range(rows)]) for r0 in range(rows)])


def _attrs(kernel: str, m: int) -> dict:
    return {RULE: f"thomas_tune.{kernel}", TILE_ANNOTATION: m}


@dataclass(frozen=True)
class Conv:
    """A stride-1 correlation ``y[n, o, h, w] = sum_{i, a, b} xpad[n, i, h + a, w + b]
    W[o, i, a, b]``: the input's shape (N, C_in, H, W), the filter size r, C_out, the padding
    (top, left, bottom, right), and whether W is a transposed convolution's filter (IOHW,
    flipped: ``W[o, i, a, b] = w[i, o, r-1-a, r-1-b]``)."""

    x_shape: tuple[int, int, int, int]
    c_out: int
    r: int
    padding: tuple[int, int, int, int]
    transposed: bool = False

    @classmethod
    def from_dict(cls, d: dict) -> "Conv":
        """The Conv of ``dataclasses.asdict(conv)`` read back from JSON (lists for tuples)."""
        return cls(tuple(d["x_shape"]), int(d["c_out"]), int(d["r"]), tuple(d["padding"]),
                   bool(d["transposed"]))

    @property
    def out_hw(self) -> tuple[int, int]:
        _, _, h, w = self.x_shape
        pt, pl, pb, pr = self.padding
        return h + pt + pb - self.r + 1, w + pl + pr - self.r + 1

    def tiles(self, m: int) -> tuple[int, int, int]:
        """(tiles down, tiles across, P = N x both) for output tiles of m x m."""
        oh, ow = self.out_hw
        nh, nw = -(-oh // m), -(-ow // m)
        return nh, nw, self.x_shape[0] * nh * nw


def weight_te(w: te.Tensor, conv: Conv, m: int) -> te.Tensor:
    """U (alpha, alpha, C_in, C_out) = G W G^T for each channel pair; ``w`` is (C_out, C_in,
    r, r) (OIHW), or (C_in, C_out, r, r) (IOHW) for a transposed convolution."""
    _, g, _ = exact_matrices(m, conv.r)
    alpha, r = m + conv.r - 1, conv.r
    c_in = conv.x_shape[1]

    def u(e, f, i, o):
        def filt(a, b):
            return w[i, o, r - 1 - a, r - 1 - b] if conv.transposed else w[o, i, a, b]
        return _transform(g, e, f, filt, w.dtype)

    return te.compute((alpha, alpha, c_in, conv.c_out), u, name="winograd_weight",
                      attrs=_attrs("winograd_weight", m))


def input_te(x: te.Tensor, conv: Conv, m: int) -> te.Tensor:
    """V (alpha, alpha, C_in, P) = B^T d B for each input tile d (alpha x alpha, its rows and
    columns starting at multiples of m in the padded input, zero outside ``x``); ``x`` is
    (N, C_in, H, W); tile p is image p // (tiles down x across), row-major within it."""
    _, _, bt = exact_matrices(m, conv.r)
    alpha = m + conv.r - 1
    _, c_in, h, w = conv.x_shape
    nh, nw, p_n = conv.tiles(m)
    pt, pl, _, _ = conv.padding

    def tile(i, p, a, b):
        n, th, tw = p // (nh * nw), (p // nw) % nh, p % nw
        hh, ww = th * m + a - pt, tw * m + b - pl
        inside = tirx.all(hh >= 0, hh < h, ww >= 0, ww < w)
        return tirx.if_then_else(inside, x[n, i, hh, ww], tirx.const(0.0, x.dtype))

    # each tile's values, read once into registers by the schedule (the transform reads each
    # of them for several outputs); kept as a block of its own ("None": no other rule takes it)
    d = te.compute((c_in, p_n, alpha, alpha), tile, name="winograd_tile",
                   attrs={RULE: "None"})
    return te.compute((alpha, alpha, c_in, p_n),
                      lambda e, f, i, p: _transform(bt, e, f, lambda a, b: d[i, p, a, b],
                                                    x.dtype),
                      name="winograd_input", attrs=_attrs("winograd_input", m))


def matmul_te(u: te.Tensor, v: te.Tensor) -> te.Tensor:
    """M (alpha, alpha, C_out, P) = sum over C_in of U[e, u, i, o] V[e, u, i, p]: one matmul
    per tile position."""
    alpha, _, c_in, c_out = u.shape
    p_n = v.shape[3]
    i = te.reduce_axis((0, c_in), name="i")
    return te.compute((alpha, alpha, c_out, p_n),
                      lambda e, f, o, p: te.sum(u[e, f, i, o] * v[e, f, i, p], axis=i),
                      name="winograd_matmul")


def output_te(mm: te.Tensor, conv: Conv, m: int) -> te.Tensor:
    """y (N, C_out, OH, OW) = A^T M A, each output read from its tile's alpha x alpha values."""
    at, _, _ = exact_matrices(m, conv.r)
    nh, nw, _ = conv.tiles(m)
    oh, ow = conv.out_hw

    def y(n, o, h, w):
        p = n * (nh * nw) + (h // m) * nw + w // m
        return _transform(at, h % m, w % m, lambda a, b: mm[a, b, o, p], mm.dtype)

    return te.compute((conv.x_shape[0], conv.c_out, oh, ow), y, name="winograd_output",
                      attrs=_attrs("winograd_output", m))


def _ints(values) -> tuple[int, ...]:
    return tuple(int(v) for v in values)


def eligible(call: relax.Call) -> Conv | None:
    """The :class:`Conv` of a ``relax.nn.conv2d`` or ``relax.nn.conv2d_transpose`` call that
    this form can compute (NCHW, stride 1, dilation 1, one group, a square filter of a size in
    :data:`TILE`, static shapes, a float dtype, no output padding), else None."""
    op = call.op
    if not isinstance(op, tvm.ir.Op) or op.name not in ("relax.nn.conv2d",
                                                          "relax.nn.conv2d_transpose"):
        return None
    a = call.attrs
    transposed = op.name == "relax.nn.conv2d_transpose"
    try:
        x_shape = _ints(call.args[0].ty.shape)
        w_shape = _ints(call.args[1].ty.shape)
    except (TypeError, AttributeError):
        return None
    dtype = str(call.args[0].ty.dtype)
    if (a.data_layout != "NCHW" or (a.out_layout or "NCHW") != "NCHW"
            or a.kernel_layout != ("IOHW" if transposed else "OIHW")
            or _ints(a.strides) != (1, 1) or _ints(a.dilation) != (1, 1) or int(a.groups) != 1
            or not dtype.startswith("float") or str(call.args[1].ty.dtype) != dtype
            or (a.out_dtype and str(a.out_dtype) not in ("", "void", dtype))):
        return None
    if transposed and _ints(a.output_padding) != (0, 0):
        return None
    r = w_shape[2]
    if w_shape[3] != r or r not in TILE:
        return None
    c_out = w_shape[1] if transposed else w_shape[0]
    if (w_shape[0] if transposed else w_shape[1]) != x_shape[1]:
        return None
    pad = _ints(a.padding)
    if transposed:  # the correlation's padding: r - 1 - p on each side
        pad = tuple(r - 1 - p for p in pad)
        if min(pad) < 0:
            return None
    conv = Conv(x_shape, c_out, r, pad, transposed)
    if min(conv.out_hw) < 1:
        return None
    return conv


#: relax's pattern kinds (``tvm.relax.transform.AnnotateTIROpPattern``): an opaque kernel is
#: fused with nothing
OPAQUE = 8


def _emit(bb: relax.BlockBuilder, x: relax.Expr, w: relax.Expr, conv: Conv) -> relax.Expr:
    m = TILE[conv.r]
    u = bb.emit(bb.call_te(lambda w_: weight_te(w_, conv, m), w,
                           primfunc_name_hint="winograd_weight"))
    v_call = bb.call_te(lambda x_: input_te(x_, conv, m), x, primfunc_name_hint="winograd_input")
    # the input transform reads each value up to (alpha / m)^2 times: fused after the ReLU
    # that makes its input, that ReLU's output would be an array inside the kernel
    gv = v_call.args[0]
    bb.update_func(gv, bb.get()[gv].with_attr("op_pattern", OPAQUE))
    v = bb.emit(v_call)
    mm = bb.emit(bb.call_te(matmul_te, u, v, primfunc_name_hint="winograd_matmul"))
    return bb.call_te(lambda mm_: output_te(mm_, conv, m), mm,
                      primfunc_name_hint="winograd_output")


@relax.expr_functor.mutator
class _Rewriter(relax.PyExprMutator):
    def __init__(self, mod: tvm.IRModule, choose):
        super().__init__(mod)
        self.choose = choose
        self.count = 0

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        call = super().visit_call_(call)
        conv = eligible(call)
        if conv is None or not self.choose(call, conv):
            return call
        self.count += 1
        return _emit(self.builder_, call.args[0], call.args[1], conv)


def convolutions(mod: tvm.IRModule) -> set[Conv]:
    """The :class:`Conv` of every eligible convolution (:func:`eligible`) in the Relax
    functions of ``mod``."""
    found: set[Conv] = set()

    def visit(e):
        if isinstance(e, relax.Call):
            conv = eligible(e)
            if conv is not None:
                found.add(conv)

    for func in mod.functions.values():
        if isinstance(func, relax.Function):
            relax.analysis.post_order_visit(func, visit)
    return found


def candidates(mod: tvm.IRModule) -> set[Conv]:
    """The convolutions of ``mod`` that a build may compute in the Winograd form: in a module
    that computes data gradients (a training step: transposed convolutions among its eligible
    ones), those of the filter sizes in :data:`GRADIENT_FILTERS`, its forward convolutions
    staying direct (:func:`thomas_tune.tasks.choose_winograd` says why); in any other module
    (a forward pass), every eligible convolution (:func:`convolutions`)."""
    convs = convolutions(mod)
    if any(c.transposed for c in convs):
        return {c for c in convs if c.transposed and c.r in GRADIENT_FILTERS}
    return convs


def rewrite(mod: tvm.IRModule, choose=lambda call, conv: True) -> tuple[tvm.IRModule, int]:
    """``mod`` with each eligible convolution (:func:`eligible`) for which ``choose(call,
    conv)`` is true computed in the Winograd form; returns (module, convolutions rewritten).
    The module's other functions and calls are unchanged."""
    rw = _Rewriter(mod, choose)
    for gv, func in mod.functions.items():
        if isinstance(func, relax.Function):
            new = rw.visit_expr(func)
            rw.builder_.update_func(gv, new)
    return rw.builder_.get(), rw.count
