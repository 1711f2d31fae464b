"""Export, load back, train: the loss goes down, frozen layers stay bit-identical; errors."""

import os

import numpy as np
import pytest
from PIL import Image

from thomas_tune import cli, data
from thomas_tune.compiler.export import export
from thomas_tune.manifest import Manifest
from thomas_tune.models import build, init_params, load_checkpoint, save_checkpoint
from thomas_tune.runtime import Session

from conftest import REFERENCE


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("export"))
    # MobileNetV1 compiles in about half MobileNetV2's time; the models' own tests cover both.
    # LLVM's optimisation off (compile.reference_target): these tests take a few steps, whose
    # numbers are the same at every level, and the build takes about half the CPU time
    model = build("mobilenet_v1", num_classes=10, resolution=32, width=0.25)
    export(out, model, init_params(model, seed=3), REFERENCE, batch=8,
           trainable="last:3", progress=lambda *_: None)
    return out


def test_training_steps_lower_the_loss_and_keep_frozen_layers(exported, rng):
    s = Session(exported, seed=int(rng.integers(1000)))
    m = s.manifest
    x = rng.standard_normal((8, 3, 32, 32)).astype("float32")
    y = rng.integers(0, 10, 8)
    before = s.tensors()
    losses = [s.train_step(x, y) for _ in range(8)]
    after = s.tensors()
    assert losses[-1] < losses[0]
    assert all(np.array_equal(before[n], after[n]) for n in m.frozen)
    # (BatchNorm scales are left out: at initialisation their gradient can be below float32's
    # resolution at 1.0)
    assert all(not np.array_equal(before[n], after[n]) for n in m.trainable
               if "bn." not in n)
    # the default for last:K: frozen layers' BatchNorms in inference form, their running
    # statistics unchanged; the trainable layers' follow the data (train mode, as PyTorch)
    frozen_bn = set(m.frozen_bn)
    assert m.batchnorm == "frozen-part" and frozen_bn
    for n in m.states:
        layer = n.rsplit(".", 1)[0]
        assert np.array_equal(before[n], after[n]) == (layer in frozen_bn), n
    assert s.predict(x[:3]).shape == (3, 10)


def test_manifest_and_atomic_checkpoint(exported, tmp_path):
    m = Manifest.read(exported)
    assert m.arch == "mobilenet_v1" and m.target["kind"] == "llvm"
    assert m.trainable and m.frozen and m.tuning_log_sha256 is None
    model, tensors, _ = load_checkpoint(os.path.join(exported, "params.npz"))
    bad = dict(tensors)
    bad.pop(next(iter(bad)))
    path = tmp_path / "ck.npz"
    with pytest.raises(ValueError, match="missing"):
        save_checkpoint(str(path), model, bad)
    assert os.listdir(tmp_path) == []  # nothing half-written


def test_wrong_input_shape_is_a_clear_error(exported, rng):
    s = Session(exported)
    with pytest.raises(ValueError, match="expected float32"):
        s.train_step(rng.standard_normal((8, 3, 64, 64)).astype("float32"), np.zeros(8, int))


def _write_images(folder, classes, per_class, rng):
    for c in classes:
        os.makedirs(folder / c, exist_ok=True)
        for i in range(per_class):
            arr = rng.integers(0, 255, (20, 24, 3), dtype=np.uint8)
            Image.fromarray(arr).save(folder / c / f"{i}.png")


def test_image_folder(tmp_path, rng):
    _write_images(tmp_path, ["cat", "dog", "eel"], 4, rng)
    d = data.load(str(tmp_path), 32)
    assert d.x.shape == (12, 3, 32, 32) and d.classes == ["cat", "dog", "eel"]
    assert sorted(set(d.y.tolist())) == [0, 1, 2]


@pytest.mark.quick
def test_image_folder_errors(tmp_path, rng):
    with pytest.raises(ValueError, match="does not exist"):
        data.load(str(tmp_path / "nope"), 32)
    _write_images(tmp_path / "one", ["only"], 2, rng)
    with pytest.raises(ValueError, match="at least 2"):
        data.load(str(tmp_path / "one"), 32)
    os.makedirs(tmp_path / "empty" / "a")
    os.makedirs(tmp_path / "empty" / "b")
    with pytest.raises(ValueError, match="no images"):
        data.load(str(tmp_path / "empty"), 32)
    _write_images(tmp_path / "broken", ["a", "b"], 2, rng)
    (tmp_path / "broken" / "a" / "bad.png").write_bytes(b"not a png")
    with pytest.raises(ValueError, match="cannot be read"):
        data.load(str(tmp_path / "broken"), 32)


def test_shipped_mnist_is_real_and_balanced():
    d = data.load("mnist5k", 32, limit=200)
    assert d.x.shape == (200, 3, 32, 32)
    assert np.bincount(d.y).tolist() == [20] * 10
    assert d.x.std() > 0.5  # real images, not constants


def test_train_out_leaves_an_export_that_infers_with_the_fine_tuned_weights(tmp_path, rng,
                                                                            capsys):
    """``train --out E --save ck.npz`` then ``infer --export E IMAGE``: E holds the fine-tuned
    weights (those of ck.npz, not the initial ones) and the data's class names."""
    _write_images(tmp_path / "data", ["cat", "dog", "eel"], 6, rng)
    out, ck = tmp_path / "E", tmp_path / "ck.npz"
    assert cli.main(["train", "--model", "mobilenet_v1", "--width", "0.25", "--resolution",
                     "32", "--classes", "3", "--batch", "4", "--trainable", "last:2",
                     "--data", str(tmp_path / "data"), "--steps", "3", "--lr", "0.1",
                     "--out", str(out), "--save", str(ck), "--quiet"]) == 0
    _, saved, _ = load_checkpoint(str(ck))
    _, in_export, classes = load_checkpoint(str(out / "params.npz"))
    assert classes == ["cat", "dog", "eel"]
    initial = init_params(build("mobilenet_v1", num_classes=3, resolution=32, width=0.25),
                          seed=0)
    changed = [k for k in saved if not np.array_equal(saved[k], initial[k])]
    assert changed, "training changed no weight"
    for k in saved:
        np.testing.assert_array_equal(in_export[k], saved[k])
    capsys.readouterr()
    image = tmp_path / "data" / "dog" / "0.png"
    assert cli.main(["infer", "--export", str(out), str(image)]) == 0
    printed = capsys.readouterr().out
    assert printed.startswith(f"{image}: ") and printed.split(": ")[1].split(" ")[0] in classes


@pytest.mark.quick
def test_divergence_names_a_rising_loss_a_non_finite_one_and_chance_accuracy():
    from thomas_tune.train import TrainReport, divergence, likely_cause
    rng = np.random.default_rng(0)
    learning = TrainReport(0.2, 0.9, 100, losses=list(np.linspace(1.6, 0.3, 100)
                                                      + 0.2 * rng.random(100)))
    assert divergence(learning, 5, 200) == []
    rising = TrainReport(0.6, 0.2, 150, losses=list(np.linspace(1.0, 1.6, 150)))
    signs = divergence(rising, 5, 200)
    assert len(signs) == 2 and "the loss rose" in signs[0] and "chance" in signs[1], signs
    assert "not finite from step 4" in divergence(
        TrainReport(0.2, 0.1, 10, losses=[1.0, 2.0, 9.0, float("nan")] + [0.0] * 6), 5, 200)[0]
    # accuracy above chance by more than two standard errors is no sign
    assert divergence(TrainReport(0.5, 0.30, 150, losses=[1.0] * 150), 5, 200) == []
    from types import SimpleNamespace  # the fields of a Manifest that likely_cause reads
    manifest = SimpleNamespace(optimizer={"lr": 0.01}, batchnorm="frozen", frozen=[])
    assert "0.01" in likely_cause(manifest) and "frozen-bn" in likely_cause(manifest)
    manifest.batchnorm = "train"
    assert "frozen-bn" not in likely_cause(manifest)


def test_train_warns_when_the_run_diverges(tmp_path, rng, capsys):
    """A real run at a learning rate far too high: the loss leaves its start and ``train``
    says the run diverged, naming the learning rate."""
    _write_images(tmp_path / "data", ["cat", "dog", "eel"], 10, rng)
    assert cli.main(["train", "--model", "mobilenet_v1", "--width", "0.25", "--resolution",
                     "32", "--classes", "3", "--batch", "4", "--trainable", "last:2",
                     "--data", str(tmp_path / "data"), "--steps", "60", "--lr", "1000",
                     "--quiet"]) == 0
    err = capsys.readouterr().err
    assert "warning: the run diverged" in err and "learning rate (1000)" in err, err


@pytest.mark.quick  # the subset for edits (pytest -m quick): the CLI's argument errors
def test_cli_errors(capsys):
    assert cli.main(["tasks", "--target", "no-such-kind"]) == 2
    assert "target" in capsys.readouterr().err
    assert cli.main(["tasks", "--trainable", "last:0"]) == 2
    assert "--trainable" in capsys.readouterr().err
    assert cli.main(["train", "--export", "/nonexistent"]) == 2
    assert "thomas-tune export" in capsys.readouterr().err
