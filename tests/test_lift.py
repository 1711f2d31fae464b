"""The frozen parameters' transforms lifted out of the training step
(``thomas_tune/training_graph/lift.py``): the split step gives the numbers of the whole one, its
Winograd weight transforms run in the lifting function only, and an export runs them once per
load."""

import numpy as np
import pytest
import tvm
from tvm import relax

from thomas_tune.training_graph import graph as G
from thomas_tune.training_graph import lift
from thomas_tune import opencl
from thomas_tune.compiler.compile import compile_graph
from thomas_tune.manifest import ADJOINT_FROZEN
from thomas_tune.models import build
from thomas_tune.tasks import callees, fuse, lifted_slots

from conftest import SMALL, random_tensors
from opencl_kernels import NEEDS_OPENCL as needs_opencl  # the one OpenCL guard


def _marked(tg):
    mod = tg.mod
    mod[G.ADJOINT] = mod[G.ADJOINT].with_attr(lift.ATTR, [1 + len(tg.masks), len(tg.frozen)])
    return mod


def test_winograd_weight_transforms_leave_the_step():
    """AlexNet ``last:3`` with its convolutions in the Winograd form: the step calls no weight
    transform, the lifting function calls one per Winograd convolution (the first bias's
    reshape is a view there, no kernel), and the frozen parameters the step reads as
    they are (the first convolution's weight, the biases its fused kernels reshape) are slots
    of their own; the fused kernels that read a frozen bias beside activations stay as they
    are."""
    model = build("alexnet", **SMALL["alexnet"])
    tg = G.training_module(model, 2, "last:3")
    whole = callees(fuse(tg.mod, "all")[G.ADJOINT])
    n_wino = sum(n for k, n in whole.items() if k.startswith("winograd_weight"))
    assert n_wino == 4  # the four 3x3 and 5x5 stride-1 convolutions
    mod = fuse(_marked(tg), "all")
    step = callees(mod[G.ADJOINT])
    assert not [k for k in step if k.startswith("winograd_weight")]
    lifted = callees(mod["train_adjoint_transform_params"])
    assert sum(lifted.values()) == n_wino
    assert not [k for k in whole if k.startswith("reshape")]
    assert sum(step.values()) == sum(whole.values()) - n_wino
    assert {k: n for k, n in whole.items() if k.startswith("fused_")} == \
        {k: n for k, n in step.items() if k.startswith("fused_")}
    slots = lifted_slots(fuse(_marked(G.training_module(model, 2, "last:3")), "all"))[G.ADJOINT]
    assert slots[:5] == ["features.0.weight", "features.3.bias", "features.6.bias",
                         "features.8.bias", "features.10.bias"]
    assert slots[5:] == [""] * 5
    with pytest.raises(ValueError, match="frozen parameters at"):
        bad = tg.mod
        bad[G.ADJOINT] = bad[G.ADJOINT].with_attr(lift.ATTR, [1, 100])
        lift.lift_frozen(bad)


@needs_opencl
def test_split_step_gives_the_whole_steps_numbers(rng):
    """On PoCL, the whole step and the split one (lifting function, then the step on its
    values), both in the Winograd form, on the same fresh random weights and batch: the same
    loss and gradients, to the bit (the same kernels compute the same values)."""
    model = build("alexnet", **SMALL["alexnet"])
    batch = 2
    tensors = random_tensors(model, rng)
    target = opencl.target_for(0)
    dev = tvm.opencl(0)
    tg = G.training_module(model, batch, "last:3")
    whole = relax.VirtualMachine(compile_graph(tg.mod, target, None, "all"), dev)
    split = relax.VirtualMachine(compile_graph(_marked(G.training_module(model, batch, "last:3")),
                                               target, None, "all"), dev)
    slots = lifted_slots(fuse(_marked(G.training_module(model, batch, "last:3")), "all"))[
        G.ADJOINT]

    def t(a, dtype="float32"):
        return tvm.runtime.tensor(np.asarray(a, dtype=dtype), dev)

    x = rng.standard_normal(model.input_shape(batch))
    y = rng.integers(0, model.num_classes, batch)
    masks = [t((rng.random(shape) >= p) / (1 - p)) for shape, p in tg.masks.values()]
    rest = [t(tensors[n]) for n in (*tg.trainable, *tg.states)] + [t(y, "int64")]
    frozen = [t(tensors[n]) for n in tg.frozen]
    ret, grads = whole[G.ADJOINT](t(x), *masks, *frozen, *rest)
    lifted = iter(list(split[ADJOINT_FROZEN](*frozen)))
    slot_args = [t(tensors[s]) if s else next(lifted) for s in slots]
    ret2, grads2 = split[G.ADJOINT](t(x), *masks, *slot_args, *rest)
    assert next(lifted, None) is None  # every lifted value has its slot
    loss, loss2 = (float((r[0] if tg.states else r).numpy()) for r in (ret, ret2))
    assert np.isfinite(loss) and loss == loss2
    for name, g, g2 in zip(tg.trainable, grads, grads2):
        assert np.abs(g.numpy()).max() > 0, name
        np.testing.assert_array_equal(g.numpy(), g2.numpy(), err_msg=name)


@needs_opencl
def test_an_export_lifts_once_per_load(tmp_path, rng):
    """An AlexNet ``last:3`` export on PoCL: its manifest names the step's slots; the lifting
    function runs before the first step only (its launches are not repeated), and again after
    ``load_tensors``, whose new frozen weights the next step uses (the loss of a fresh session
    made with them)."""
    from build_cache import export  # the session's build of these inputs
    from thomas_tune.runtime import Session
    model = build("alexnet", **SMALL["alexnet"])
    tensors = random_tensors(model, rng)
    m = export(str(tmp_path), model, tensors, opencl.target_for(0), batch=4, infer_batch=1,
               trainable="last:3", progress=lambda *_: None)
    assert m.frozen_slots and "" in m.frozen_slots  # a bias reshaped once
    x = rng.standard_normal(model.input_shape(4)).astype("float32")
    y = rng.integers(0, model.num_classes, 4)
    s = Session(str(tmp_path))
    launches = []
    for _ in range(3):
        before = opencl.stats()["launches"]
        s.train_step(x, y)
        s.sync()
        launches.append(opencl.stats()["launches"] - before)
    assert launches[0] > launches[1] == launches[2]
    # new frozen parameters: the lifted values must follow them. A session that never saw the
    # old ones, its dropout seeds drawn as far (three steps), gives the step's loss on them
    other = {k: (v * rng.uniform(0.5, 1.5, v.shape) if k in m.frozen else v).astype("float32")
             for k, v in tensors.items()}
    fresh = Session(str(tmp_path))
    fresh.load_tensors(other)
    for _ in range(3):
        fresh.draw_masks()
    want = fresh.train_step(x, y)
    s.load_tensors(other)
    assert s.train_step(x, y) == want


@needs_opencl
def test_inference_lifts_again_after_training_steps(tmp_path, rng):
    """Inference lifts what it computes from the parameters alone (an AlexNet export with every
    layer trainable, whose convolutions' biases are reshaped once): after training steps its
    logits are those of a fresh session loaded with the trained tensors, not of the lifted
    values before the steps."""
    from build_cache import export  # the session's build of these inputs
    from thomas_tune.runtime import Session
    model = build("alexnet", **SMALL["alexnet"])
    m = export(str(tmp_path), model, random_tensors(model, rng), opencl.target_for(0), batch=4,
               infer_batch=1, trainable="all", progress=lambda *_: None)
    assert m.frozen_slots is None and "" in m.predict_slots
    x = rng.standard_normal(model.input_shape(4)).astype("float32")
    y = rng.integers(0, model.num_classes, 4)
    s = Session(str(tmp_path))
    before = s.predict(x[:1])
    for _ in range(2):
        s.train_step(x, y)
    now = Session(str(tmp_path))
    now.load_tensors(s.tensors())
    after = s.predict(x[:1])
    np.testing.assert_array_equal(after, now.predict(x[:1]))
    assert not np.array_equal(after, before)


@needs_opencl
def test_frozen_batchnorms_fold_into_their_convolutions_once(tmp_path, rng):
    """MobileNetV2 ``last:2``: every frozen BatchNorm follows a frozen convolution and is folded
    into it; the step computes no normalisation (no square root) and no fold, the lifting
    function every fold; the export's step on PoCL passes the step check against PyTorch's
    float64 step (loss and every gradient)."""
    from build_cache import export  # the session's build of these inputs
    from thomas_tune.training_graph.library_module import lift_request
    from thomas_tune.export_check import check_export
    model = build("mobilenet_v2", **SMALL["mobilenet_v2"])
    tg = G.training_module(model, 8, "last:2")
    attr, inputs = lift_request(tg)
    assert inputs[:len(tg.frozen)] == tg.frozen and len(inputs) > len(tg.frozen)
    mod = tg.mod
    mod[G.ADJOINT] = mod[G.ADJOINT].with_attr(lift.ATTR, attr)
    mod = fuse(mod)
    step = callees(mod[G.ADJOINT])
    assert not [k for k in step if "sqrt" in k or "bn_fold" in k]
    folds = sum(n for k, n in callees(mod["train_adjoint_transform_params"]).items()
                if k.startswith("bn_fold"))
    assert folds == len(tg.frozen_bn) > 40
    tensors = random_tensors(model, rng)
    export(str(tmp_path), model, tensors, opencl.target_for(0), batch=8, infer_batch=1,
           trainable="last:2", progress=lambda *_: None)
    check = check_export(str(tmp_path), seed=int(rng.integers(1 << 30)))
    assert check.ok, check.line()  # the loss, every gradient, no dead weight, enough values
