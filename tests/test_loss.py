"""The training step's loss (thomas_tune/loss.py) against PyTorch's cross-entropy, in float64,
and its kernels in a model's step."""

import numpy as np
import pytest
import torch
import tvm
from tvm import relax

from thomas_tune import graph as G
from thomas_tune.compile import compile_graph
from thomas_tune.loss import CrossEntropyLoss
from thomas_tune.models import build
from thomas_tune.target import parse_target

from conftest import SMALL


def _loss_and_grad(dtype, n, c):
    """A VM running the loss function and its gradient (``main_adjoint``) for (n, c) logits."""
    loss = CrossEntropyLoss(relax.TensorType((n, c), dtype), relax.TensorType((n,), "int64"))
    func = loss()
    mod = loss.add_kernel(tvm.IRModule({"main": func.with_attr("global_symbol", "main")}))
    mod = relax.transform.Gradient("main", require_grads=[mod["main"].params[0]])(mod)
    # the adjoint alone, as the training graph keeps it (its forward call is a plain call_tir)
    mod = relax.transform.DeadCodeElimination(["main_adjoint"])(
        tvm.IRModule({gv: f for gv, f in mod.functions.items() if gv.name_hint != "main"}))
    return relax.VirtualMachine(compile_graph(mod, parse_target("llvm")), tvm.cpu())


@pytest.mark.parametrize("scale", [1.0, 300.0])
def test_cross_entropy_and_gradient_match_pytorch(rng, scale):
    """Loss and gradient of the mean softmax cross-entropy against ``F.cross_entropy`` in
    float64, on ordinary logits and on logits so large (x 300) that an exponential without the
    row's maximum taken out overflows."""
    n, c = 7, 13
    x = rng.standard_normal((n, c)) * scale
    y = rng.integers(0, c, n)
    vm = _loss_and_grad("float64", n, c)
    loss, (grad,) = vm["main_adjoint"](tvm.runtime.tensor(x), tvm.runtime.tensor(y))
    tx = torch.tensor(x, requires_grad=True)
    ref = torch.nn.functional.cross_entropy(tx, torch.tensor(y))
    ref.backward()
    np.testing.assert_allclose(float(loss.numpy()), ref.detach().item(), rtol=1e-12)
    np.testing.assert_allclose(grad.numpy(), tx.grad.numpy(), rtol=1e-10,
                               atol=1e-14 * np.abs(tx.grad.numpy()).max())


def test_cross_entropy_in_float32_is_as_close_to_float64_as_pytorchs(rng):
    """In float32, the loss and the gradient are within 2x PyTorch float32's own distance from
    float64 (the larger of it and a few float32 roundings), on 1,000 classes at batch 32 (over
    20 seeds: at most 1.05x for the gradient, 0.45x for the loss)."""
    n, c = 32, 1000
    x = rng.standard_normal((n, c)).astype("float32") * 4
    y = rng.integers(0, c, n)
    loss, (grad,) = _loss_and_grad("float32", n, c)["main_adjoint"](
        tvm.runtime.tensor(x), tvm.runtime.tensor(y))

    def torch_loss(dtype):
        tx = torch.tensor(x.astype(dtype), requires_grad=True)
        out = torch.nn.functional.cross_entropy(tx, torch.tensor(y))
        out.backward()
        return out.detach().item(), tx.grad.numpy().astype("float64")

    (l64, g64), (l32, g32) = torch_loss("float64"), torch_loss("float32")
    eps = np.finfo("float32").eps
    assert abs(float(loss.numpy()) - l64) <= 2 * max(abs(l32 - l64), 4 * eps * l64)
    scale = np.abs(g64).max()
    ours, theirs = np.abs(grad.numpy() - g64).max(), np.abs(g32 - g64).max()
    assert ours <= 2 * max(theirs, 4 * eps * scale), (ours, theirs)


def test_the_step_computes_the_loss_in_two_kernels_and_its_gradient_in_one():
    """A model's fused step calls the loss's forward and backward kernels once each, and none
    of Relax's generic cross-entropy (log_softmax, nll_loss and their gradients); the backward
    reads the forward's row lanes instead of reducing the rows again (one block, no
    reduction)."""
    from thomas_tune.tasks import callees, fuse
    model = build("alexnet", **SMALL["alexnet"])
    mod = fuse(G.training_module(model, 2, "last:3").mod)
    calls = callees(mod[G.ADJOINT])
    grads = [k for k in calls if k.removeprefix("fused_").startswith("cross_entropy_grad")]
    assert calls.get("cross_entropy") == 1 and len(grads) == 1 and calls[grads[0]] == 1, calls
    text = mod[grads[0]].script()
    blocks = text.count("with T.sblock(") - text.count("# with T.sblock(")  # root: a comment
    assert "ce_lanes" not in text and blocks == 1, text
    assert not [k for k in calls if "softmax" in k or "nll" in k], calls
    assert not [k for k in calls if "transpose" in k], calls  # weight gradients read dy in place
