"""Each gradient thomas_tune registers matches central finite differences in float64."""

import numpy as np
import pytest
import tvm
from tvm import relax
from tvm.relax import op as R

from thomas_tune.training_graph import gradients
from thomas_tune.target import parse_target


def _compile_grad(build_out, shapes):
    """f(x..) = sum(out * w) with w a fixed random weight; returns (value_fn, grad_fn)."""
    bb = relax.BlockBuilder()
    xs = [relax.Var(f"x{i}", relax.TensorType(s, "float64")) for i, s in enumerate(shapes)]
    with bb.function("main"):
        with bb.dataflow():
            out = bb.emit(build_out(*xs))
            w = relax.Var("w", relax.TensorType(out.ty.shape, "float64"))
            loss = bb.emit_output(R.sum(R.multiply(out, w)))
        bb.emit_func_output(loss, params=[*xs, w])
    mod = bb.get()
    mod = relax.transform.Gradient("main", require_grads=mod["main"].params[:len(xs)])(mod)
    ex = tvm.compile(mod, parse_target("llvm"))
    vm = relax.VirtualMachine(ex, tvm.cpu())
    out_shape = [int(v) for v in mod["main"].params[-1].ty.shape.values]
    return vm, out_shape


def _check(build_out, shapes, rng, data=None, tol=1e-6):
    vm, out_shape = _compile_grad(build_out, shapes)
    xs = data or [rng.standard_normal(s) for s in shapes]
    w = rng.standard_normal(out_shape)
    t = lambda a: tvm.runtime.tensor(np.asarray(a, "float64"))  # noqa: E731
    f = lambda *a: float(vm["main"](*[t(v) for v in a], t(w)).numpy())  # noqa: E731
    _, grads = vm["main_adjoint"](*[t(v) for v in xs], t(w))
    eps = 1e-6
    for i, x in enumerate(xs):
        num = np.zeros_like(x)
        for idx in np.ndindex(x.shape):
            xp = [v.copy() for v in xs]
            xm = [v.copy() for v in xs]
            xp[i][idx] += eps
            xm[i][idx] -= eps
            num[idx] = (f(*xp) - f(*xm)) / (2 * eps)
        got = grads[i].numpy()
        np.testing.assert_allclose(got, num, rtol=tol, atol=tol * max(1.0, np.abs(num).max()))


@pytest.mark.quick
def test_missing_gradients_finds_ops_without_one_and_none_of_ours_is_missing():
    """``missing_gradients`` names an op with no gradient in the pinned TVM (argmax, which
    thomas_tune does not register), and none of the ops thomas_tune registers."""
    assert gradients.missing_gradients(("relax.argmax", "relax.nn.relu")) == ["relax.argmax"]
    assert gradients.missing_gradients() == []
    gradients.register()  # a second registration changes nothing
    assert gradients.missing_gradients(gradients.OPS + ("relax.argmax",)) == ["relax.argmax"]


@pytest.mark.quick
def test_clip_relu6(rng):
    x = rng.uniform(-3, 9, (3, 7))
    x[np.abs(x) < 1e-3] = 0.5  # keep finite differences away from the kinks
    x[np.abs(x - 6) < 1e-3] = 5.5
    _check(lambda a: R.clip(a, 0.0, 6.0), [(3, 7)], rng, data=[x])


@pytest.mark.quick
def test_relu_gradient_reads_the_output(rng):
    """ReLU's gradient (from its output, thomas_tune's) against finite differences, and the
    backward holds no use of ReLU's input: only the output is kept."""
    x = rng.standard_normal((3, 7))
    x[np.abs(x) < 1e-3] = 0.5  # keep finite differences away from the kink
    _check(lambda a: R.nn.relu(a), [(3, 7)], rng, data=[x])
    bb = relax.BlockBuilder()
    a = relax.Var("a", relax.TensorType((3, 7), "float32"))
    with bb.function("main", [a]):
        with bb.dataflow():
            y = bb.emit(R.nn.relu(R.multiply(a, a)))
            loss = bb.emit_output(R.sum(y))
        bb.emit_func_output(loss)
    mod = relax.transform.Gradient("main")(bb.get())
    func = mod["main_adjoint"]
    bindings = [b for blk in func.body.blocks for b in blk.bindings]
    squared = [b.var for b in bindings if isinstance(b.value, relax.Call)
               and b.value.op.same_as(tvm.ir.Op.get("relax.multiply"))
               and all(arg.same_as(func.params[0]) for arg in b.value.args)][0]
    readers = [b.value.op.name for b in bindings if isinstance(b.value, relax.Call)
               and any(arg.same_as(squared) for arg in b.value.args)]
    assert readers == ["relax.nn.relu"], readers


@pytest.mark.quick
def test_transposed_matmul_is_one_kernel_and_right(rng):
    """``matmul(permute_dims(a), b)``, the form of a linear layer's weight gradient, becomes
    one kernel that reads ``a`` in place, with the same values (float64)."""
    bb = relax.BlockBuilder()
    a = relax.Var("a", relax.TensorType((5, 3), "float64"))
    b = relax.Var("b", relax.TensorType((5, 4), "float64"))
    with bb.function("main", [a, b]):
        with bb.dataflow():
            out = bb.emit_output(R.matmul(R.permute_dims(a), b))
        bb.emit_func_output(out)
    mod = gradients.transpose_free_matmuls(bb.get())
    kernels = [gv.name_hint for gv, f in relax.transform.LegalizeOps()(mod).functions.items()
               if isinstance(f, tvm.tirx.PrimFunc)]
    assert kernels == ["matmul_tn"], kernels
    vm = relax.VirtualMachine(tvm.compile(mod, parse_target("llvm")), tvm.cpu())
    av, bv = rng.standard_normal((5, 3)), rng.standard_normal((5, 4))
    got = vm["main"](tvm.runtime.tensor(av), tvm.runtime.tensor(bv)).numpy()
    np.testing.assert_allclose(got, av.T @ bv, rtol=1e-13)


@pytest.mark.quick
def test_flatten(rng):
    _check(lambda a: R.flatten(a), [(2, 3, 2, 2)], rng)


@pytest.mark.quick
@pytest.mark.parametrize("in_hw,out_hw", [((4, 4), 1), ((2, 3), (6, 6)), ((7, 5), (3, 2))])
def test_adaptive_avg_pool2d(rng, in_hw, out_hw):
    _check(lambda a: R.nn.adaptive_avg_pool2d(a, out_hw), [(2, 2, *in_hw)], rng)


@pytest.mark.quick
def test_adaptive_pool_matrix_matches_numpy_mean():
    from thomas_tune.training_graph.gradients import adaptive_pool_matrix
    p = adaptive_pool_matrix(7, 3)
    x = np.arange(7.0)
    np.testing.assert_allclose(p @ x, [x[0:3].mean(), x[2:5].mean(), x[4:7].mean()])


@pytest.mark.quick
@pytest.mark.parametrize("training", [True, False])
def test_batch_norm(rng, training):
    c = 3
    shapes = [(4, c, 3, 3), (c,), (c,), (c,), (c,)]
    data = [rng.standard_normal(shapes[0]), rng.uniform(0.5, 1.5, c), rng.standard_normal(c),
            rng.standard_normal(c) * 0.1, rng.uniform(0.5, 1.5, c)]

    def bn(x, g, b, m, v):
        out = R.nn.batch_norm(x, g, b, m, v, axis=1, training=training)
        return relax.TupleGetItem(out, 0)

    vm, out_shape = _compile_grad(bn, shapes)
    w = rng.standard_normal(out_shape)
    t = lambda a: tvm.runtime.tensor(np.asarray(a, "float64"))  # noqa: E731
    _, grads = vm["main_adjoint"](*[t(v) for v in data], t(w))
    # finite differences for x, gamma, beta (running statistics are not differentiated)
    f = lambda *a: float(vm["main"](*[t(v) for v in a], t(w)).numpy())  # noqa: E731
    eps = 1e-6
    for i in range(3):
        num = np.zeros_like(data[i])
        for idx in np.ndindex(data[i].shape):
            p = [v.copy() for v in data]
            m = [v.copy() for v in data]
            p[i][idx] += eps
            m[i][idx] -= eps
            num[idx] = (f(*p) - f(*m)) / (2 * eps)
        np.testing.assert_allclose(grads[i].numpy(), num, rtol=1e-5, atol=1e-6)


@pytest.mark.quick
def test_dropout_gradient_follows_its_lowering(rng):
    # This TVM lowers dropout to the identity with an all-ones mask: the gradient is dy.
    _check(lambda a: relax.TupleGetItem(R.nn.dropout(a, 0.3), 0), [(2, 5)], rng)


@pytest.mark.quick
@pytest.mark.parametrize("stride,padding,dilation,hw", [
    (1, (1, 1, 1, 1), 1, (6, 5)),   # MobileNet's stride-1 layers
    (1, (2, 0, 1, 2), 2, (7, 6)),   # stride 1, uneven padding, dilation 2
    (2, (1, 1, 1, 1), 1, (7, 6)),   # stride 2, odd size: the last row/column is never read
    (2, (0, 1, 2, 0), 2, (9, 8)),   # uneven padding, dilation 2
])
def test_depthwise_conv2d(rng, stride, padding, dilation, hw):
    """Depthwise conv2d's own backward kernels (data and weight) against finite differences."""
    c = 3
    shapes = [(2, c, *hw), (c, 1, 3, 3)]
    _check(lambda x, w: R.nn.conv2d(x, w, strides=stride, padding=padding, dilation=dilation,
                                    groups=c), shapes, rng)


@pytest.mark.quick
def test_depthwise_gradient_is_used_only_for_depthwise():
    """Grouped (not depthwise) and dense convolutions keep TVM's gradient."""
    x = relax.Var("x", relax.TensorType((1, 4, 5, 5), "float32"))
    for w_shape, groups, depthwise in (((4, 1, 3, 3), 4, True), ((4, 2, 3, 3), 2, False),
                                       ((8, 4, 3, 3), 1, False)):
        w = relax.Var("w", relax.TensorType(w_shape, "float32"))
        call = R.nn.conv2d(x, w, groups=groups)
        bb = relax.BlockBuilder()
        with bb.function("f", [x, w]):
            y = bb.emit(call)
            bb.emit_func_output(y)
        assert gradients.is_depthwise(bb.get()["f"].body.blocks[0].bindings[0].value) is depthwise
        with bb.function("g", [x, w]):
            with bb.dataflow():
                loss = bb.emit_output(R.sum(R.nn.conv2d(x, w, groups=groups)))
            bb.emit_func_output(loss)
        names = {gv.name_hint for gv in relax.transform.Gradient("g")(bb.get()).functions}
        assert ("depthwise_weight_grad" in names) is depthwise


def _max_pool_grad_reference(x, dy, kernel, stride, padding, out_hw):
    """dL/dx of max pooling in float64 by its definition: each window's ``dy`` goes to the
    window's largest element, the first in row-major order on ties (PyTorch's rule); padding
    never holds the maximum."""
    (kh, kw), (sh, sw), (pt, pl, pb, pr) = kernel, stride, padding
    n, c, h, w = x.shape
    # room for ceil-mode windows that run past the bottom/right padding
    xp = np.full((n, c, h + pt + pb + kh, w + pl + pr + kw), -np.inf)
    xp[:, :, pt:pt + h, pl:pl + w] = x
    dxp = np.zeros_like(xp)
    for i, j in np.ndindex(*out_hw):
        win = xp[:, :, i * sh:i * sh + kh, j * sw:j * sw + kw].reshape(n, c, -1)
        first = win.argmax(axis=-1)  # numpy's argmax takes the first maximum
        a, b = np.divmod(first, kw)
        nn, cc = np.indices((n, c))
        np.add.at(dxp, (nn, cc, i * sh + a, j * sw + b), dy[:, :, i, j])
    return dxp[:, :, pt:pt + h, pl:pl + w]


@pytest.mark.parametrize("kernel,stride,padding,ceil_mode,hw", [
    ((3, 3), (2, 2), (0, 0, 0, 0), False, (13, 13)),  # AlexNet's pools
    ((3, 3), (2, 2), (1, 1, 1, 1), False, (8, 7)),    # ResNet's stem pool
    ((2, 2), (2, 2), (0, 0, 0, 0), False, (6, 8)),    # windows that do not overlap
    ((3, 3), (1, 1), (1, 1, 1, 1), False, (5, 6)),    # stride 1: nine windows per element
    # uneven, ceil mode: the one case in the subset for edits (pytest -m quick), 2 of 14 s
    pytest.param((3, 2), (2, 1), (1, 0, 0, 1), True, (7, 6), marks=pytest.mark.quick),
])
def test_max_pool2d_gradient_is_one_kernel_with_pytorch_ties(rng, kernel, stride, padding,
                                                              ceil_mode, hw):
    """Max pooling's gradient (thomas_tune's one-kernel form) against its definition in float64
    on inputs full of ties (values from {0, 1, 2}, as after a ReLU): the first maximum of each
    window in row-major order takes the window's gradient. And the backward has one kernel
    for it, named as TVM's."""
    shape = (2, 3, *hw)
    bb = relax.BlockBuilder()
    xv = relax.Var("x", relax.TensorType(shape, "float64"))
    with bb.function("main"):
        with bb.dataflow():
            y = bb.emit(R.nn.max_pool2d(xv, kernel, stride, padding, ceil_mode=ceil_mode))
            wv = relax.Var("w", relax.TensorType(y.ty.shape, "float64"))
            loss = bb.emit_output(R.sum(R.multiply(y, wv)))
        bb.emit_func_output(loss, params=[xv, wv])
    mod = relax.transform.Gradient("main", require_grads=[xv])(bb.get())
    kernels = [gv.name_hint for gv, f in relax.transform.LegalizeOps()(mod).functions.items()
               if isinstance(f, tvm.tirx.PrimFunc) and "backward" in gv.name_hint]
    assert kernels == ["max_pool2d_backward"], kernels
    vm = relax.VirtualMachine(tvm.compile(mod, parse_target("llvm")), tvm.cpu())
    out_hw = [int(v) for v in mod["main"].params[1].ty.shape.values][2:]
    for x in (rng.integers(0, 3, shape).astype("float64"), rng.standard_normal(shape)):
        dy = rng.standard_normal((2, 3, *out_hw))
        _, (dx,) = vm["main_adjoint"](tvm.runtime.tensor(x), tvm.runtime.tensor(dy))
        want = _max_pool_grad_reference(x, dy, kernel, stride, padding, out_hw)
        np.testing.assert_allclose(dx.numpy(), want, rtol=1e-14, atol=1e-14)
