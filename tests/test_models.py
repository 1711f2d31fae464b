"""Every model's training graph against PyTorch 2.13 in float64: loss, the gradient of every
parameter, the new BatchNorm running statistics; and the inference graph's logits."""

import numpy as np
import pytest
import tvm
from tvm import relax

from conftest import REFERENCE, SMALL, TorchGraph, random_tensors
from thomas_tune.training_graph import graph as G
from thomas_tune.training_graph import optimizers
from thomas_tune.compiler.compile import compile_graph
from thomas_tune.models import build, spec

torch = pytest.importorskip("torch")
RTOL = 1e-7  # float64 on both sides; only summation order differs


def _torch_reference(model, tensors, x, y, masks, training):
    names = {q.name for q in spec(model).params}
    p = {k: torch.tensor(v, dtype=torch.float64, requires_grad=True)
         for k, v in tensors.items() if k in names}
    st = {k: torch.tensor(v, dtype=torch.float64) for k, v in tensors.items() if k not in names}
    tm = {k: torch.tensor(v, dtype=torch.float64) for k, v in masks.items()}
    g = TorchGraph(p, st, tm, training)
    logits = model.forward(g, torch.tensor(x, dtype=torch.float64))
    loss = torch.nn.functional.cross_entropy(logits, torch.tensor(y))
    if training:
        loss.backward()
    return logits.detach().numpy(), float(loss.detach()), p, g.new_states


def _close(got, ref, what):
    scale = max(np.abs(ref).max(), 1e-3)
    err = np.abs(np.asarray(got) - ref).max() / scale
    assert err < RTOL, f"{what}: relative error {err:.2e}"


def _run_adjoint(model, tg, tensors, batch, rng):
    """A fresh batch, labels and dropout masks, and ``train_adjoint`` of ``tg`` compiled for
    the float64 reference target run on them: (x, y, masks, ret, grads, the VM)."""
    vm = relax.VirtualMachine(compile_graph(tg.mod, REFERENCE), tvm.cpu())
    x = rng.standard_normal(model.input_shape(batch))
    y = rng.integers(0, model.num_classes, batch)
    masks = {k: (rng.random(shape) >= p) / (1 - p) for k, (shape, p) in tg.masks.items()}
    t = lambda a: tvm.runtime.tensor(np.asarray(a))  # noqa: E731
    ret, grads = vm[G.ADJOINT](t(x), *[t(masks[k]) for k in tg.masks],
                               *[t(tensors[n]) for n in tg.frozen + tg.trainable + tg.states],
                               t(y.astype("int64")))
    return x, y, masks, ret, grads, vm


# AlexNet's case (about 6 s) is in the subset for edits (pytest -m quick); the MobileNets' 20-40 s
@pytest.mark.parametrize("arch", [pytest.param(a, marks=pytest.mark.quick) if a == "alexnet" else a
                                  for a in sorted(SMALL)])
def test_training_graph_matches_pytorch(arch, rng):
    model = build(arch, **SMALL[arch])
    batch = 4
    tensors = {k: v.astype("float64") for k, v in random_tensors(model, rng).items()}
    tg = G.training_module(model, batch, "all", dtype="float64")
    x, y, masks, ret, grads, vm = _run_adjoint(model, tg, tensors, batch, rng)
    t = lambda a: tvm.runtime.tensor(np.asarray(a))  # noqa: E731
    loss = ret[0] if tg.states else ret
    ref_logits, ref_loss, p, new_states = _torch_reference(model, tensors, x, y, masks, True)
    _close(float(loss.numpy()), ref_loss, "loss")
    for name, grad in zip(tg.trainable, grads):
        _close(grad.numpy(), p[name].grad.numpy(), f"gradient of {name}")
    for name, value in zip(tg.states, list(ret)[1:] if tg.states else []):
        _close(value.numpy(), new_states[name].numpy(), f"running statistic {name}")

    # inference graph: BatchNorm on running statistics, no dropout
    s = spec(model)
    ref_logits, _, _, _ = _torch_reference(model, tensors, x, y, masks, False)
    logits = vm[G.PREDICT](t(x), *[t(tensors[q.name]) for q in s.params + s.states]).numpy()
    _close(logits, ref_logits, "inference logits")


@pytest.mark.quick
def test_standard_sizes_have_torchvision_parameter_counts():
    # torchvision: mobilenet_v2 3,504,872; alexnet 61,100,840 parameters (BN stats excluded).
    for arch, want in (("mobilenet_v2", 3_504_872), ("alexnet", 61_100_840)):
        got = sum(int(np.prod(p.shape)) for p in spec(build(arch)).params)
        assert got == want, arch


def test_frozen_layers_get_no_gradient_and_no_backward():
    model = build("mobilenet_v2", **SMALL["mobilenet_v2"])
    full = G.training_module(model, 2, "all")
    last = G.training_module(model, 2, "last:2")
    s = spec(model)  # (a trace of the model: once, not once per parameter)
    assert set(last.trainable) == {p.name for p in s.params if p.block in s.blocks[-2:]}
    assert not set(last.trainable) & set(last.frozen)
    ops = lambda tg: str(tg.mod[G.ADJOINT]).count("R.nn.conv2d")  # noqa: E731
    # the backward of frozen blocks is not computed: far fewer convolutions
    assert ops(last) < ops(full) / 2


def test_linear_layers_read_their_weight_in_place():
    """The fused AlexNet graphs (training and inference) hold no kernel that writes a linear
    layer's transposed weight: the forward matmul reads W (out, in) as it is stored."""
    from thomas_tune.tasks import fuse
    model = build("alexnet", **SMALL["alexnet"])
    tg = G.training_module(model, 2, "all")
    weights = [tuple(p.shape) for p in spec(model).params if p.init == "linear"]
    assert len(weights) == 3
    for gv, func in fuse(tg.mod).functions.items():
        if isinstance(func, tvm.tirx.PrimFunc):
            shapes = [tuple(int(d) for d in v.ty.shape) for v in func.params]
            # a copy of one weight (out, in) into (in, out)
            copies = len(shapes) == 2 and shapes[0] in weights and shapes[1] == shapes[0][::-1]
            assert not copies, gv.name_hint


@pytest.mark.quick
@pytest.mark.parametrize("bad", ["last:0", "last:999", "first:2", "some"])
def test_bad_trainable_is_a_clear_error(bad):
    model = build("mobilenet_v2", **SMALL["mobilenet_v2"])
    with pytest.raises(ValueError, match="--trainable"):
        G.select_trainable(model, bad)


@pytest.mark.parametrize("name", ["momentum_sgd", pytest.param("sgd", marks=pytest.mark.quick),
                                  "adam"])
def test_optimizer_update_matches_pytorch(name, rng):
    # two updates of the optimizer function against torch.optim on the same gradients, float64,
    # for 30 parameters of assorted shapes
    shapes = [tuple(int(d) for d in rng.integers(1, 6, size=rng.integers(1, 5)))
              for _ in range(30)]
    params = [relax.Var(f"p{i}", relax.TensorType(s, "float64")) for i, s in enumerate(shapes)]
    cfg = optimizers.OptimizerConfig(name=name, lr=0.05, weight_decay=0.01)
    opt = cfg.build().init(params)
    mod = optimizers.optimizer_module(opt)
    vm = relax.VirtualMachine(compile_graph(mod, REFERENCE), tvm.cpu())
    p0 = [rng.standard_normal(s) for s in shapes]
    tp = [torch.tensor(v, requires_grad=True) for v in p0]
    if name == "adam":
        topt = torch.optim.Adam(tp, lr=0.05, betas=cfg.betas, eps=cfg.eps, weight_decay=0.01)
    else:
        topt = torch.optim.SGD(tp, lr=0.05, momentum=cfg.momentum if name == "momentum_sgd"
                               else 0.0, weight_decay=0.01)
    cur, state = [tvm.runtime.tensor(v) for v in p0], opt.state
    for _ in range(2):
        grads = [rng.standard_normal(s) for s in shapes]
        for t, g in zip(tp, grads):
            t.grad = torch.tensor(g)
        topt.step()
        before = cur
        cur, state = vm["optimizer"](cur, [tvm.runtime.tensor(g) for g in grads], state)
        cur = list(cur)
        # in place: the tensors passed in hold the new parameters (no second copy)
        for old, new in zip(before, cur):
            np.testing.assert_array_equal(old.numpy(), new.numpy())
    for got, ref in zip(cur, tp):
        np.testing.assert_allclose(got.numpy(), ref.detach().numpy(), rtol=1e-10, atol=1e-12)
    assert int(state[0].numpy()) == 2  # the step count, advanced by the update kernel
    # 30 parameters in multi-tensor kernels of at most 128 buffers, updated in place: momentum
    # SGD (3 buffers a parameter), SGD (2) and Adam (4, its two scalars and the step count)
    # one kernel each, which also counts the step; Adam's two scalars (beta^t) are more
    from thomas_tune.tasks import fuse
    kernels = [f for f in fuse(mod).functions.values() if isinstance(f, tvm.tirx.PrimFunc)]
    assert len(kernels) == {"momentum_sgd": 1, "sgd": 1, "adam": 1 + 2}[name]


def test_last_layers_train_with_frozen_batchnorms_in_inference_form(rng):
    """``last:K`` (BatchNorm mode ``frozen-part``): the frozen layers' BatchNorms run on their
    running statistics (PyTorch's ``eval()`` on those modules) and keep them; the trainable
    layers' BatchNorms normalise with the batch's. Loss, gradients and new statistics match
    PyTorch in float64; no statistics kernel runs for a frozen BatchNorm."""
    from thomas_tune.tasks import callees, fuse
    model = build("mobilenet_v2", **SMALL["mobilenet_v2"])
    batch = 4
    tensors = {k: v.astype("float64") for k, v in random_tensors(model, rng).items()}
    tg = G.training_module(model, batch, "last:3", dtype="float64")
    assert tg.batchnorm == "frozen-part"
    bns = {q.name.rsplit(".", 1)[0] for q in spec(model).states}
    trained_bns = {n for n in bns if f"{n}.weight" in tg.trainable}
    assert trained_bns and tg.frozen_bn == bns - trained_bns
    x, y, masks, ret, grads, _ = _run_adjoint(model, tg, tensors, batch, rng)
    p = {k: torch.tensor(v, requires_grad=k in tg.trainable) for k, v in tensors.items()
         if k not in tg.states}
    st = {k: torch.tensor(tensors[k]) for k in tg.states}
    g = TorchGraph(p, st, {k: torch.tensor(v) for k, v in masks.items()}, True,
                   frozen_bn=tg.frozen_bn)
    loss = torch.nn.functional.cross_entropy(model.forward(g, torch.tensor(x)),
                                             torch.tensor(y))
    loss.backward()
    _close(float(ret[0].numpy()), float(loss.detach()), "loss")
    for name, grad in zip(tg.trainable, grads):
        _close(grad.numpy(), p[name].grad.numpy(), f"gradient of {name}")
    for name, value in zip(tg.states, list(ret)[1:]):
        layer = name.rsplit(".", 1)[0]
        want = tensors[name] if layer in tg.frozen_bn else g.new_states[name].numpy()
        _close(value.numpy(), want, f"running statistic {name}")
    calls = callees(fuse(tg.mod)[G.ADJOINT])
    assert sum(n for k, n in calls.items() if k.startswith("bn_stats")) == len(trained_bns)


def test_batchnorm_and_optimizer_kernels_per_step():
    """The training form of each BatchNorm is four kernels (the statistics, normalisation with
    its activation, two for the backward), the new running statistics of
    all of them a few multi-tensor kernels (one per feature-map size, 18 BatchNorms at most
    each: MobileNetV2 has six sizes and at most 21 BatchNorms of one), and momentum SGD
    updates the parameters in place in one kernel per group of 42 (128 buffers, 3 a
    parameter), the first of which also counts the step."""
    from thomas_tune.tasks import callees, fuse
    model = build("mobilenet_v2", **SMALL["mobilenet_v2"])
    tg = G.training_module(model, 2, "all")
    mod = fuse(tg.mod)
    calls = callees(mod[G.ADJOINT])
    n_bn = sum(1 for q in spec(model).states if q.name.endswith(".running_mean"))

    def count(prefix):
        return sum(n for k, n in calls.items() if k.startswith(prefix)
                   or k.startswith(f"fused_{prefix}"))

    for kernel in ("bn_stats", "bn_act_reduce", "bn_act_dx"):
        assert count(kernel) == n_bn, kernel
    assert not [k for k in calls if k.startswith(("bn_psum", "bn_combine", "bn_sums"))]
    assert 0 < count("bn_running") <= 6 + 1
    assert count("bn_act") - count("bn_act_reduce") - count("bn_act_dx") == n_bn
    # nothing else of BatchNorm's generic form is left (mean, variance, their backward)
    assert not [k for k in calls if "variance" in k or "mean" in k]
    n_params = len(tg.trainable)
    assert sum(callees(mod[G.OPTIMIZER]).values()) == -(-n_params // 42)  # (128 - 1) // 3
