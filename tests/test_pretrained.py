"""Pretrained weights: ONNX files written by PyTorch 2.13's exporter (random weights, torchvision
layout) imported and checked against onnxruntime; bad files; head replacement; dropout and
BatchNorm modes."""

import numpy as np
import pytest
import tvm

from conftest import REFERENCE, random_tensors, torch_module
from thomas_tune.training_graph import graph as G
from thomas_tune.compiler.compile import compile_graph
from thomas_tune.models import build, load_checkpoint, replace_head, spec
from thomas_tune.models.onnx_import import import_onnx
from thomas_tune.target import parse_target

torch = pytest.importorskip("torch")
ort = pytest.importorskip("onnxruntime")

CASES = [("mobilenet_v2", dict(num_classes=6, resolution=64, width=0.35), True),
         ("mobilenet_v2", dict(num_classes=6, resolution=64, width=0.35), False),
         ("mobilenet_v1", dict(num_classes=6, resolution=64, width=0.25), True),
         # AlexNet (about 9 s) is in the subset for edits (pytest -m quick)
         pytest.param("alexnet", dict(num_classes=6, resolution=67, width=0.1), True,
                      marks=pytest.mark.quick)]


def _export_onnx(model, tensors, path, optimize=True):
    net = torch_module(model, tensors)
    x = torch.randn(1, *model.input_shape(1)[1:])
    torch.onnx.export(net, (x,), str(path), dynamo=True, optimize=optimize, verbose=False)


def _predict(model, tensors, x):
    s = spec(model)
    vm = tvm.relax.VirtualMachine(
        compile_graph(G.inference_module(model, x.shape[0]), REFERENCE), tvm.cpu())
    args = [tvm.runtime.tensor(tensors[q.name]) for q in s.params + s.states]
    return vm[G.PREDICT](tvm.runtime.tensor(x), *args).numpy()


@pytest.mark.parametrize("arch,config,optimize", CASES)
def test_onnx_import_matches_onnxruntime(arch, config, optimize, tmp_path, rng):
    model = build(arch, **config)
    path = tmp_path / "net.onnx"
    _export_onnx(model, random_tensors(model, rng), path, optimize)
    imported, tensors, report = import_onnx(str(path), arch, width=config["width"])
    assert imported.config() == model.config()
    # optimize=True folds BatchNorm into the convolutions (as torchvision exports usually are)
    assert bool(report.fused_batchnorms) == (optimize and arch != "alexnet")
    x = rng.standard_normal(model.input_shape(1)).astype("float32")
    ref = ort.InferenceSession(str(path)).run(None, {"x": x})[0]
    got = _predict(imported, tensors, x)
    err = np.abs(got - ref).max() / np.abs(ref).max()
    assert err < 1e-4, err


def test_onnx_that_does_not_map_names_the_first_node(tmp_path, rng):
    model = build("mobilenet_v2", num_classes=6, resolution=64, width=0.75)
    path = tmp_path / "wide.onnx"
    _export_onnx(model, random_tensors(model, rng), path)
    with pytest.raises(ValueError, match=r"ONNX node '.*' \(Conv: weight \(24, 3, 3, 3\).*"
                                         r"does not map to model layer 'features.0.0'"):
        import_onnx(str(path), "mobilenet_v2", width=0.35)
    with pytest.raises(ValueError, match="is 64x64, not the 96x96"):
        import_onnx(str(path), "mobilenet_v2", width=0.75, resolution=96)


@pytest.mark.quick
def test_unreadable_onnx_file(tmp_path):
    bad = tmp_path / "bad.onnx"
    bad.write_bytes(b"\x08\x07not a protobuf at all" * 10)
    with pytest.raises(ValueError, match="not a readable ONNX model"):
        import_onnx(str(bad), "mobilenet_v2")
    with pytest.raises(ValueError, match="does not exist"):
        import_onnx(str(tmp_path / "missing.onnx"), "mobilenet_v2")


def test_head_replacement_on_import_and_checkpoint(tmp_path, rng):
    model = build("mobilenet_v2", num_classes=6, resolution=64, width=0.35)
    tensors = random_tensors(model, rng)
    path = tmp_path / "net.onnx"
    _export_onnx(model, tensors, path)
    new, got, report = import_onnx(str(path), "mobilenet_v2", width=0.35, num_classes=3)
    assert report.replaced_head == "classifier.1" and new.num_classes == 3
    assert got["classifier.1.weight"].shape == (3, tensors["classifier.1.weight"].shape[1])
    # everything below the head is kept exactly
    new2, kept = replace_head(model, tensors, 3, seed=1)
    for k, v in tensors.items():
        if not k.startswith("classifier.1."):
            np.testing.assert_array_equal(kept[k], v)
    assert kept["classifier.1.bias"].shape == (3,)
    # through the CLI: a checkpoint with --classes gives an export with the new head
    from thomas_tune.cli import main
    from thomas_tune.models import save_checkpoint
    ckpt = tmp_path / "c.npz"
    save_checkpoint(str(ckpt), model, tensors)
    assert main(["import-onnx", str(path), "--model", "mobilenet_v2", "--width", "0.35",
                 "--classes", "4", "--out", str(tmp_path / "i.npz")]) == 0
    m4, t4, _ = load_checkpoint(str(tmp_path / "i.npz"))
    assert m4.num_classes == 4 and t4["classifier.1.weight"].shape[0] == 4
    assert not (tmp_path / "i.npz.tmp").exists()


def test_dropout_masks_follow_pytorch_semantics(tmp_path, rng):
    # inverted dropout as torch.nn.functional.dropout: kept values scaled by 1/(1-p), the
    # rest 0. The export draws a step's masks on the device (draw_masks, here on llvm) from
    # the seed Session passes: bit for bit thomas_tune.training_graph.dropout's numpy reference, a
    # fresh mask every step; inference ignores dropout.
    from thomas_tune.training_graph.dropout import mask_numpy
    from thomas_tune.compiler.compile import reference_target
    from thomas_tune.compiler.export import export
    from thomas_tune.runtime import Session
    model = build("alexnet", num_classes=4, resolution=67, width=0.1)
    # LLVM's optimisation off (``compile.reference_target``): the masks are integer hashes,
    # the same at every level, and the build takes less time
    export(str(tmp_path / "e"), model, random_tensors(model, rng),
           reference_target(parse_target("llvm")), batch=4, trainable="last:1",
           progress=lambda *_: None)
    s = Session(str(tmp_path / "e"), seed=int(rng.integers(1000)))
    specs = list(s.manifest.masks.values())
    assert len(specs) == 2
    p = specs[0]["p"]
    ref = torch.nn.functional.dropout(torch.ones(200_000, dtype=torch.float64), p,
                                      training=True).numpy()
    drawn = []
    for _ in range(40):  # 40 steps of masks of 4 x 900 and 4 x 409 values
        seed = rng.integers(0, 2 ** 32, size=2, dtype=np.uint32)
        masks = [m.numpy() for m in s.draw_masks(seed)]
        for i, (spec_, got) in enumerate(zip(specs, masks)):
            assert got.shape == tuple(spec_["shape"]) and got.dtype == np.float32
            np.testing.assert_array_equal(got, mask_numpy(seed, spec_["shape"], spec_["p"], i))
        drawn.append(masks[0].ravel())
    ours = np.concatenate(drawn)
    assert set(np.unique(ours)) == set(np.unique(ref).astype(np.float32))
    sigma = np.sqrt(p * (1 - p) / ours.size)
    assert abs((ours == 0).mean() - p) < 5 * sigma
    assert not np.array_equal(drawn[0], drawn[1])
    a, b = (m.numpy() for m in (s.draw_masks()[0], s.draw_masks()[0]))  # the session's seeds
    assert not np.array_equal(a, b)
    x = rng.standard_normal((1, 3, 67, 67)).astype("float32")
    np.testing.assert_array_equal(s.predict(x), s.predict(x))


def test_calibration_refuses_bad_input(rng):
    # checked before anything is compiled: images of another shape or dtype, a layer that is
    # not a BatchNorm, a BatchNorm with trained statistics (not the identity of a fused file)
    from thomas_tune.models.calibration import calibrate_batchnorms, identity_batchnorms
    model = build("mobilenet_v1", num_classes=4, resolution=64, width=0.25)
    tensors = random_tensors(model, rng)
    assert identity_batchnorms(model, tensors) == []
    fused = dict(tensors)
    fused.update({"features.0.bn.weight": np.ones(8, "float32"),
                  "features.0.bn.running_mean": np.zeros(8, "float32"),
                  "features.0.bn.running_var": np.full(8, 1 - 1e-5, "float32")})
    assert identity_batchnorms(model, fused) == ["features.0.bn"]
    x = rng.standard_normal((4, 3, 64, 64)).astype("float32")
    with pytest.raises(ValueError, match=r"calibration images: expected float32 \(N, 3, 64, 64"):
        calibrate_batchnorms(model, fused, x[:, :, :32])
    with pytest.raises(ValueError, match="calibration images: expected float32"):
        calibrate_batchnorms(model, fused, x.astype("float64"))
    with pytest.raises(ValueError, match="'features.0.conv' is not a BatchNorm layer"):
        calibrate_batchnorms(model, fused, x, ["features.0.conv"])
    with pytest.raises(ValueError, match="'features.1.dw_bn' holds trained statistics"):
        calibrate_batchnorms(model, fused, x, ["features.1.dw_bn"])
