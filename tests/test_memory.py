"""Training-step memory from the training graph: exact counts for parameters, gradients and
optimizer state; freezing layers saves gradients, optimizer state and kept activations."""

import numpy as np

from conftest import SMALL
from thomas_tune.training_graph.graph import select_trainable
from thomas_tune.training_graph.optimizers import OptimizerConfig
from thomas_tune.memory import training_memory
from thomas_tune.models import build, spec


def test_counts_and_what_freezing_saves():
    model = build("mobilenet_v2", **SMALL["mobilenet_v2"])
    s = spec(model)
    size = {p.name: 4 * int(np.prod(p.shape)) for p in s.params + s.states}
    full = training_memory(model, 4, "all")
    last = training_memory(model, 4, "last:2")
    assert full.parameters == last.parameters == sum(size.values())
    for mem, mode in ((full, "all"), (last, "last:2")):
        trainable = sum(size[n] for n in select_trainable(model, mode))
        assert mem.gradients == trainable
        # momentum SGD: one velocity per trainable parameter plus a step counter (TVM's
        # relax.training.optimizer.MomentumSGD state)
        assert trainable <= mem.optimizer_state <= trainable + 16
        assert mem.input_batch == 4 * 4 * 3 * 64 * 64
        # where the forward pass ends, every kept activation is live beside the parameters;
        # gradients appear as the backward frees activations, so they need not add up with them
        assert mem.peak >= mem.parameters + mem.activations_kept
        assert mem.peak >= mem.parameters + mem.gradients
    assert last.gradients < full.gradients / 2
    assert last.activations_kept < full.activations_kept / 10
    assert last.peak < full.peak / 2
    # activations grow with the batch, parameters do not
    big = training_memory(model, 8, "all")
    assert big.parameters == full.parameters
    assert 1.9 < big.activations_kept / full.activations_kept < 2.1


def test_adam_keeps_two_moments():
    model = build("mobilenet_v1", **SMALL["mobilenet_v1"])
    sgd = training_memory(model, 2, "last:1", OptimizerConfig("momentum_sgd"))
    adam = training_memory(model, 2, "last:1", OptimizerConfig("adam"))
    assert 2 * sgd.gradients <= adam.optimizer_state <= 2 * sgd.gradients + 64


def test_a_winograd_build_counts_its_transforms():
    """With the convolutions a build computes in the Winograd form, the step's estimate counts
    their transformed tensors: it grows by at least the largest transformed gradient alive at
    once (the data gradients of AlexNet's 3x3 layers, the ones a step may take in this form,
    in tiles of 4x4 for 2x2 outputs: 16 values per tile, per channel and image), and an empty
    choice changes nothing."""
    from thomas_tune.training_graph import graph as G
    from thomas_tune.training_graph import winograd_form as W
    model = build("alexnet", **SMALL["alexnet"])
    direct = training_memory(model, 2, "all")
    assert training_memory(model, 2, "all", winograd=set()) == direct
    grads = W.candidates(G.training_module(model, 2, "all").mod)
    assert len(grads) == 3 and all(c.transposed and c.r == 3 for c in grads), grads

    def transformed(conv):  # float32 bytes
        n, c, h, w = conv.x_shape
        return 4 * 16 * c * n * -(-h // 2) * -(-w // 2)
    with_wino = training_memory(model, 2, "all", winograd=grads)
    largest = max(transformed(c) for c in grads)
    assert with_wino.peak >= direct.peak + largest, (with_wino.peak, direct.peak, largest)
    assert with_wino.parameters == direct.parameters and with_wino.gradients == direct.gradients
