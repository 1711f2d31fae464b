"""The training step in one function (``graph.add_train_step``): ``train_adjoint`` and the
optimizer inlined into ``train_step``, which ``Session.train_step`` runs."""

import numpy as np

from thomas_tune.training_graph import graph as G
from thomas_tune import opencl
from thomas_tune.manifest import TRAIN_STEP
from thomas_tune.models import build
from thomas_tune.tasks import callees, fuse

from conftest import SMALL, random_tensors
from opencl_kernels import NEEDS_OPENCL as needs_opencl  # the one OpenCL guard


def test_the_step_function_calls_the_kernels_of_both():
    """``TRAIN_STEP`` of MobileNetV2 ``last:2`` (BatchNorm in training form in its trainable
    layers, the frozen ones folded) calls every kernel of ``train_adjoint`` and of the
    optimizer as often as the two do, and nothing else; its gradients are no outputs (it
    returns the loss and running statistics, the parameters and the optimizer state)."""
    model = build("mobilenet_v2", **SMALL["mobilenet_v2"])
    tg = G.training_module(model, 2, "last:2")
    mod = G.add_train_step(tg.mod, 1 + len(tg.masks) + len(tg.frozen), len(tg.trainable))
    fused = fuse(mod)
    both: dict[str, int] = {}
    for fn in (G.ADJOINT, G.OPTIMIZER):
        for k, n in callees(fused[fn]).items():
            both[k] = both.get(k, 0) + n
    assert callees(fused[TRAIN_STEP]) == both
    out = mod[TRAIN_STEP].ret_ty.fields
    assert len(out) == 3
    assert len(out[1].fields) == len(tg.trainable)  # the new parameters, not the gradients
    assert len(mod[TRAIN_STEP].params) == len(mod[G.ADJOINT].params) + 1


@needs_opencl
def test_one_function_steps_are_the_two_call_steps(tmp_path, rng):
    """An AlexNet ``last:3`` export on PoCL (dropout masks, lifted frozen inputs, momentum SGD):
    three steps of ``train_step`` and three of ``train_adjoint`` then ``optimizer`` (the same
    export, :attr:`Session.one_function_step` off) from the same seed give the same losses,
    parameters and optimizer state bit for bit, with the same launches per step."""
    from build_cache import export  # the session's build of these inputs
    from thomas_tune.runtime import Session
    model = build("alexnet", **SMALL["alexnet"])
    tensors = random_tensors(model, rng)
    m = export(str(tmp_path), model, tensors, opencl.target_for(0), batch=4,
               infer_batch=1, trainable="last:3", progress=lambda *_: None)
    assert m.train_step_slots == m.frozen_slots and m.frozen_slots
    data = [(rng.standard_normal(model.input_shape(4)).astype("float32"),
             rng.integers(0, model.num_classes, 4)) for _ in range(3)]

    def steps(one_function: bool):
        s = Session(str(tmp_path), seed=7)
        s.one_function_step = one_function
        losses, launches = [], []
        for x, y in data:
            before = opencl.stats()["launches"]
            losses.append(s.train_step(x, y))
            s.sync()
            launches.append(opencl.stats()["launches"] - before)
        return losses, launches[1:], s.tensors(), [t.numpy() for t in s._opt]

    one, two = steps(True), steps(False)
    assert one[0] == two[0] and one[1] == two[1]
    for name in one[2]:
        np.testing.assert_array_equal(one[2][name], two[2][name], err_msg=name)
    for a, b in zip(one[3], two[3]):
        np.testing.assert_array_equal(a, b)
    assert not np.array_equal(one[2]["classifier.6.weight"], tensors["classifier.6.weight"])


@needs_opencl
def test_one_function_steps_hold_less_device_memory(tmp_path, rng):
    """MobileNetV2 ``last:2`` on PoCL, measured as ``bench`` measures it
    (``benchmark.device_memory``: a fresh process, three steps): the export's peak of device
    memory is below that of the same export stepped in two calls (``one_function=False``)
    by at least half the gradients' bytes (the trainable parameters', float32), which the
    one-function step keeps in storage the step's dead tensors free instead of as outputs."""
    from thomas_tune.benchmark.exports import device_memory
    from build_cache import export  # the session's build of these inputs
    model = build("mobilenet_v2", **SMALL["mobilenet_v2"])
    tensors = random_tensors(model, rng)
    one = str(tmp_path / "one")
    # (batch 8: the build of tests/test_lift.py's folded-BatchNorm export)
    m = export(one, model, tensors, opencl.target_for(0), batch=8, infer_batch=1,
               trainable="last:2", progress=lambda *_: None)
    peaks = {"one-function": device_memory(one),
             "two-call": device_memory(one, one_function=False)}
    grad_bytes = 4 * sum(tensors[n].size for n in m.trainable)
    assert peaks["one-function"] <= peaks["two-call"] - grad_bytes // 2, (peaks, grad_bytes)
