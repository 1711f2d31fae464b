"""The training step's loss (thomas_tune/training_graph/loss.py) against PyTorch's cross-entropy, in
float64, and its kernels in a model's step."""

import numpy as np
import pytest
import torch
import tvm
from tvm import relax

from thomas_tune.training_graph import graph as G
from thomas_tune.compiler.compile import compile_graph
from thomas_tune.training_graph.loss import CrossEntropyLoss
from thomas_tune.models import build
from thomas_tune.schedules import tir_pipeline
from thomas_tune.target import codegen_target, parse_target

from conftest import SMALL
from opencl_kernels import NEEDS_OPENCL as needs_opencl  # the one OpenCL guard

# the whole file runs in seconds: all of it in the subset for edits (pytest -m quick)
pytestmark = pytest.mark.quick


def _loss_and_grad(dtype, n, c, target="llvm", factor=None):
    """A VM running the loss function and its gradient (``main_adjoint``) for (n, c) logits,
    built for ``target`` (its device: the CPU, or OpenCL); with ``factor``, the function's
    output is the loss times ``factor`` (a loss gradient other than 1). Returns (vm, device)."""
    loss = CrossEntropyLoss(relax.TensorType((n, c), dtype), relax.TensorType((n,), "int64"))
    func = loss()
    if factor is not None:  # the loss's body, its output scaled
        body = func.body
        block = body.blocks[0]
        scaled = relax.DataflowVar("scaled", body.body.ty)
        bindings = list(block.bindings) + [relax.VarBinding(scaled, relax.op.multiply(
            body.body, relax.const(factor, dtype)))]
        out = relax.Var("out", body.body.ty)
        bindings.append(relax.VarBinding(out, scaled))
        func = relax.Function(func.params, relax.SeqExpr(
            [relax.DataflowBlock(bindings)], out), body.body.ty)
    mod = loss.add_kernel(tvm.IRModule({"main": func.with_attr("global_symbol", "main")}))
    mod = relax.transform.Gradient("main", require_grads=[mod["main"].params[0]])(mod)
    # the adjoint alone, as the training graph keeps it (its forward call is a plain call_tir)
    mod = relax.transform.DeadCodeElimination(["main_adjoint"])(
        tvm.IRModule({gv: f for gv, f in mod.functions.items() if gv.name_hint != "main"}))
    dev = tvm.cpu() if target == "llvm" else tvm.opencl(0)
    return relax.VirtualMachine(compile_graph(mod, parse_target(target)), dev), dev


@pytest.mark.parametrize("scale", [1.0, 300.0])
def test_cross_entropy_and_gradient_match_pytorch(rng, scale):
    """Loss and gradient of the mean softmax cross-entropy against ``F.cross_entropy`` in
    float64, on ordinary logits and on logits so large (x 300) that an exponential without the
    row's maximum taken out overflows."""
    n, c = 7, 13
    x = rng.standard_normal((n, c)) * scale
    y = rng.integers(0, c, n)
    vm, _ = _loss_and_grad("float64", n, c)
    loss, (grad,) = vm["main_adjoint"](tvm.runtime.tensor(x), tvm.runtime.tensor(y))
    tx = torch.tensor(x, requires_grad=True)
    ref = torch.nn.functional.cross_entropy(tx, torch.tensor(y))
    ref.backward()
    np.testing.assert_allclose(float(loss.numpy()), ref.detach().item(), rtol=1e-12)
    np.testing.assert_allclose(grad.numpy(), tx.grad.numpy(), rtol=1e-10,
                               atol=1e-14 * np.abs(tx.grad.numpy()).max())


def _float32_against_pytorch(rng, target):
    """On 1,000 classes at batch 32: (ours, PyTorch float32's) distances from float64 of the
    loss and of the gradient, and the float32 rounding floors ``4 eps`` of each."""
    n, c = 32, 1000
    x = rng.standard_normal((n, c)).astype("float32") * 4
    y = rng.integers(0, c, n)
    vm, dev = _loss_and_grad("float32", n, c, target)
    loss, (grad,) = vm["main_adjoint"](tvm.runtime.tensor(x, dev), tvm.runtime.tensor(y, dev))

    def torch_loss(dtype):
        tx = torch.tensor(x.astype(dtype), requires_grad=True)
        out = torch.nn.functional.cross_entropy(tx, torch.tensor(y))
        out.backward()
        return out.detach().item(), tx.grad.numpy().astype("float64")

    (l64, g64), (l32, g32) = torch_loss("float64"), torch_loss("float32")
    eps = np.finfo("float32").eps
    scale = np.abs(g64).max()
    return ((abs(float(loss.numpy()) - l64), abs(l32 - l64), 4 * eps * l64),
            (np.abs(grad.numpy() - g64).max(), np.abs(g32 - g64).max(), 4 * eps * scale))


def test_cross_entropy_in_float32_is_as_close_to_float64_as_pytorchs(rng):
    """In float32, the loss and the gradient are within 2x PyTorch float32's own distance from
    float64 (the larger of it and a few float32 roundings), on 1,000 classes at batch 32 (over
    20 seeds: at most 1.05x for the gradient, 0.45x for the loss)."""
    for ours, theirs, floor in _float32_against_pytorch(rng, "llvm"):
        assert ours <= 2 * max(theirs, floor), (ours, theirs, floor)


@needs_opencl
def test_the_loss_is_one_work_group_on_a_gpu(rng):
    """Built for OpenCL (PoCL), the loss and its gradient are one kernel, one work-group
    (``loss.gpu_kernel``), as close to float64 as on the CPU (the bounds of the test above);
    its batch sum of the gradient (the last bias's gradient) is within a few float32
    roundings of float64's, at most PyTorch float32's own distance (a chain over the batch:
    about twice the pairwise tree's over 30 draws); a batch whose lanes overflow the local
    memory it may take keeps the scheduled stages."""
    from thomas_tune.training_graph.loss import LOCAL_BYTES, MAX_ROWS, gpu_kernel
    for ours, theirs, floor in _float32_against_pytorch(rng, "opencl"):
        assert ours <= 2 * max(theirs, floor), (ours, theirs, floor)
    n, c = 32, 1000
    target = parse_target("opencl")
    loss = CrossEntropyLoss(relax.TensorType((n, c), "float32"), relax.TensorType((n,), "int64"))
    one = gpu_kernel(loss.kernel, 256)
    lib = tvm.compile(tvm.IRModule({"main": one}), codegen_target(target),
                      tir_pipeline=tir_pipeline(target))
    assert lib.mod.imports[0].inspect_source().count("__kernel void") == 2  # declared, defined
    x = (rng.standard_normal((n, c)) * 1.5).astype("float32")
    y = rng.integers(0, c, n)
    dev = tvm.opencl(0)
    outs = [tvm.runtime.tensor(np.full(shape, np.nan, "float32"), dev)
            for shape in ((), (n, c), (c,))]
    lib["main"](tvm.runtime.tensor(x, dev), tvm.runtime.tensor(y, dev), *outs)
    tx = torch.tensor(x.astype("float64"), requires_grad=True)
    ref = torch.nn.functional.cross_entropy(tx, torch.tensor(y))
    ref.backward()
    g64 = tx.grad.numpy()
    eps = np.finfo("float32").eps
    assert abs(float(outs[0].numpy()) - ref.item()) <= 8 * eps * ref.item()
    assert np.abs(outs[1].numpy() - g64).max() <= 4 * eps * np.abs(g64).max()
    sum64 = g64.sum(axis=0)
    t32 = torch.tensor(x, requires_grad=True)
    torch.nn.functional.cross_entropy(t32, torch.tensor(y)).backward()
    theirs = np.abs(t32.grad.numpy().sum(axis=0) - sum64).max()
    ours = np.abs(outs[2].numpy() - sum64).max()
    assert ours <= max(theirs, 4 * eps * np.abs(sum64).max()), (ours, theirs)
    big = -(-LOCAL_BYTES // (34 * 4)) + 1
    for rows in (big, MAX_ROWS + 1):
        wide = CrossEntropyLoss(relax.TensorType((rows, 10), "float32"),
                                relax.TensorType((rows,), "int64"))
        assert gpu_kernel(wide.kernel, 256) is None


def test_the_last_bias_gradient_is_the_losss_batch_sum():
    """In a step, the gradient of the bias of the layer that makes the logits is the loss
    kernel's own batch sum (``loss.batch_sums``): AlexNet with its last layer alone trainable
    sums nothing over the batch in a kernel of its own, and with every layer trainable it has
    one batch sum fewer than the same step without the rewrite. (Its numbers are PyTorch's in
    float64: ``test_models.py::test_training_graph_matches_pytorch``.)"""
    from thomas_tune.training_graph import loss as L
    from thomas_tune.tasks import callees, fuse
    model = build("alexnet", **SMALL["alexnet"])
    tg = G.training_module(model, 4, "last:1")
    assert tg.trainable == ["classifier.6.weight", "classifier.6.bias"]
    calls = callees(fuse(tg.mod)[G.ADJOINT])
    assert not [k for k in calls if "collapse_sum" in k], calls
    whole = G.training_module(model, 4, "all").mod
    sums = sum(n for k, n in callees(fuse(whole)[G.ADJOINT]).items() if "collapse_sum" in k)
    original, L.batch_sums = L.batch_sums, lambda mod: mod
    try:
        G.batch_sums = L.batch_sums
        plain = G.training_module(model, 4, "all").mod
    finally:
        L.batch_sums = G.batch_sums = original
    assert sum(n for k, n in callees(fuse(plain)[G.ADJOINT]).items()
               if "collapse_sum" in k) == sums + 1


def test_a_loss_gradient_other_than_one_scales_the_logits_gradient(rng):
    """The loss times 2.5 as the function's output: its gradient is 2.5 times PyTorch's, in
    float64 (the forward's gradient scaled in a kernel of its own)."""
    n, c = 5, 7
    x = rng.standard_normal((n, c))
    y = rng.integers(0, c, n)
    vm, _ = _loss_and_grad("float64", n, c, factor=2.5)
    out, (grad,) = vm["main_adjoint"](tvm.runtime.tensor(x), tvm.runtime.tensor(y))
    tx = torch.tensor(x, requires_grad=True)
    ref = 2.5 * torch.nn.functional.cross_entropy(tx, torch.tensor(y))
    ref.backward()
    np.testing.assert_allclose(float(out.numpy()), ref.item(), rtol=1e-12)
    np.testing.assert_allclose(grad.numpy(), tx.grad.numpy(), rtol=1e-10,
                               atol=1e-14 * np.abs(tx.grad.numpy()).max())


def test_the_step_computes_the_loss_and_its_gradient_in_one_kernel():
    """A model's fused step calls the loss's kernel once, no other kernel of the loss (a loss
    gradient of 1: no scaling), and none of Relax's generic cross-entropy (log_softmax,
    nll_loss and their gradients)."""
    from thomas_tune.tasks import callees, fuse
    model = build("alexnet", **SMALL["alexnet"])
    mod = fuse(G.training_module(model, 2, "last:3").mod)
    calls = callees(mod[G.ADJOINT])
    assert calls.get("cross_entropy") == 1, calls
    assert not [k for k in calls if "cross_entropy" in k and k != "cross_entropy"], calls
    assert not [k for k in calls if "softmax" in k or "nll" in k], calls
    assert not [k for k in calls if "transpose" in k], calls  # weight gradients read dy in place
