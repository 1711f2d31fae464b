"""train --cache-features: the frozen part once per image, the last layers trained on its output,
the same numbers as the full step; refused where the frozen part changes from step to step."""

import json
import os
import shutil

import numpy as np
import pytest

from thomas_tune import cli
from thomas_tune.training_graph import graph as G
from thomas_tune.data import Dataset
from thomas_tune.compiler.export import export
from thomas_tune.models import build, init_params
from thomas_tune.runtime import Session
from thomas_tune.manifest import Manifest
from thomas_tune.models import load_checkpoint
from thomas_tune.export_check import check_export
from thomas_tune.step_check import manifest_frozen_bn, reference_steps
from thomas_tune.train import fine_tune

from conftest import REFERENCE, random_tensors
from opencl_kernels import NEEDS_OPENCL

# MobileNetV1 0.25@32, last:2: the last block (depthwise and pointwise convolutions, BatchNorm
# in training form: 8 values per channel at batch 8) and the classifier (dropout, linear)
MODEL = dict(num_classes=10, resolution=32, width=0.25)


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("export"))
    model = build("mobilenet_v1", **MODEL)
    # LLVM's optimisation off (compile.reference_target): the tests compare numbers, the same
    # at every level, and the build takes about half the CPU time
    export(out, model, init_params(model, seed=5), REFERENCE, batch=8,
           trainable="last:2", progress=lambda *_: None, cache_features=True)
    return out


def test_the_cached_path_trains_as_the_full_step_on_the_same_batches_and_masks(exported, rng):
    seed = int(rng.integers(1000))
    full, cached = Session(exported, seed=seed), Session(exported, seed=seed)
    m = full.manifest
    assert m.features["shape"] == [256, 1, 1]  # features.12's output per image
    assert m.features["head_states"] == [n for n in m.states if n.startswith("features.13")]
    assert "" in m.features_slots  # the frozen BatchNorms' folds, computed once per load
    tensors = random_tensors(full.model, rng)
    full.load_tensors(tensors)
    cached.load_tensors(tensors)
    x = rng.standard_normal((20, 3, 32, 32)).astype("float32")  # 3 chunks, the last padded
    y = rng.integers(0, 10, 20)
    feats = cached.features(x)
    assert feats.shape == (20, 256, 1, 1) and np.all(np.isfinite(feats))
    # a chunk's padding does not leak into its images' features
    np.testing.assert_array_equal(cached.features(x[16:]), feats[16:])
    order = rng.permutation(20)
    for i in range(4):  # momentum carries from step to step
        sel = order[(i * 8) % 16:(i * 8) % 16 + 8]
        a = full.train_step(x[sel], y[sel])
        b = cached.train_step_features(feats[sel], y[sel])
        assert abs(a - b) <= 1e-6 * abs(a), (i, a, b)
    after_full, after_cached = full.tensors(), cached.tensors()
    for n in m.trainable + m.features["head_states"]:
        ref = after_full[n]
        err = np.max(np.abs(after_cached[n] - ref)) / max(np.max(np.abs(ref)), 1e-30)
        assert err <= 1e-5, (n, err)
        # it trained (BatchNorm scales left out: their step can be below float32's resolution)
        assert ref.ndim < 2 or not np.array_equal(ref, tensors[n]), n
    for n in m.frozen + m.features["frozen_states"]:
        np.testing.assert_array_equal(after_cached[n], tensors[n])
    # held-out evaluation is the full predict, whichever path trained
    np.testing.assert_allclose(cached.predict(x[:2]), full.predict(x[:2]), rtol=1e-4,
                               atol=1e-5)


def test_fine_tune_with_cached_features_gives_the_same_run(exported, rng):
    images = rng.standard_normal((40, 3, 32, 32)).astype("float32")
    labels = rng.integers(0, 10, 40)
    train = Dataset(images[:32], labels[:32], [str(i) for i in range(10)], "random")
    test = Dataset(images[32:], labels[32:], train.classes, "random")
    reports = [fine_tune(Session(exported, seed=3), train, test, 6, seed=3,
                         show_progress=False, cache_features=c) for c in (False, True)]
    np.testing.assert_allclose(reports[1].losses, reports[0].losses, rtol=1e-5)
    assert reports[1].features_bytes == 32 * 256 * 4 and reports[1].features_s > 0
    assert reports[0].features_bytes == 0 and reports[1].train_s > 0


def test_train_cli_caches_features(exported, capsys):
    rc = cli.main(["train", "--export", exported, "--cache-features", "--steps", "3",
                   "--limit", "100", "--quiet"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "features of the 80 training images computed once" in out


def test_an_export_without_the_split_names_the_fix(exported, tmp_path, rng):
    old = str(tmp_path / "old")
    shutil.copytree(exported, old)
    path = os.path.join(old, "manifest.json")
    m = json.load(open(path))
    m["features"] = None
    json.dump(m, open(path, "w"))
    s = Session(old)
    with pytest.raises(ValueError, match="export it again with --cache-features"):
        s.features(rng.standard_normal((8, 3, 32, 32)).astype("float32"))


@pytest.mark.parametrize("arch,trainable,fix", [
    ("mobilenet_v1", "last:2,train-bn", "drop ',train-bn'"),
    ("alexnet", "last:2", r"dropout classifier\.0 .*--trainable last:3 or more"),
    ("mobilenet_v1", "all", "needs --trainable last:K"),
    ("mobilenet_v1", "last:15", r"K in 1\.\.14"),
])
def test_a_frozen_part_that_changes_from_step_to_step_is_refused(arch, trainable, fix):
    model = build(arch, num_classes=5, resolution=67 if arch == "alexnet" else 32, width=0.25)
    with pytest.raises(ValueError, match=fix):
        G.training_module(model, 8, trainable, features=True)


def test_the_cut_is_the_one_tensor_the_trainable_layers_read():
    model = build("alexnet", num_classes=5, resolution=67, width=0.1)
    tg = G.training_module(model, 8, "last:3", features=True)
    # the last max pool's output, before the classifier's adaptive pooling
    assert tg.features.shape == (25, 1, 1) and tg.features.head_states == []
    head = tg.mod[G.HEAD_ADJOINT]
    assert [p.name for p in head.params][:3] == ["features", "classifier.0.mask",
                                                      "classifier.3.mask"]


def test_the_step_on_cached_features_needs_less_memory():
    from thomas_tune.memory import training_memory
    model = build("mobilenet_v2", num_classes=5, resolution=64, width=0.35)
    full = training_memory(model, 8, "last:2")
    cached = training_memory(model, 8, "last:2", features=True)
    assert cached.input_batch == 8 * 112 * 2 * 2 * 4 < full.input_batch == 8 * 3 * 64 * 64 * 4
    # the same parameters resident, gradients and optimizer state; no frozen activations
    assert (cached.parameters, cached.gradients, cached.optimizer_state) == (
        full.parameters, full.gradients, full.optimizer_state)
    assert cached.peak < full.peak


@NEEDS_OPENCL
def test_the_cached_step_on_opencl_matches_the_full_step_and_float64(tmp_path, target, rng):
    # the loss and every trainable gradient of features + train_head_adjoint on PoCL, against
    # PyTorch float64 within step_check's bounds, and the same export's full step
    out = str(tmp_path / "cl")
    model = build("mobilenet_v1", **MODEL)
    # the llvm export's parameters: from other seeds the frozen part can leave the last
    # block's input all zero (ReLUs), a dead layer the check cannot judge
    export(out, model, init_params(model, seed=5), target, batch=8,
           trainable="last:2", progress=lambda *_: None, cache_features=True)
    m = Manifest.read(out)
    model, tensors, _ = load_checkpoint(os.path.join(out, "params.npz"))
    reference = reference_steps(model, tensors, m.trainable, m.batch,
                                int(rng.integers(1 << 20)), manifest_frozen_bn(m))
    check = check_export(out, reference=reference, cached=True)
    assert check.ok, check.line()
    full = check_export(out, reference=reference)
    assert abs(check.loss - full.loss) <= 1e-6 * abs(full.loss)
