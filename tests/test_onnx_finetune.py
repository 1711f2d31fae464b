"""Fine-tuning a network pretrained in PyTorch and imported from ONNX, against PyTorch itself.

A torchvision-layout MobileNetV2 and MobileNetV1 are pretrained in PyTorch (float32, the
project's mirror of the models) on the shipped MNIST digits 0-4 once per test session, exported
with ``torch.onnx.export`` in eval mode with BatchNorm fused into the convolutions (the
exporter's default) and with BatchNorm kept (``training=TrainingMode.PRESERVE``), imported,
and trained in float64 by the compiled training module (llvm) beside PyTorch in float64 on the
same batches and dropout masks:

(a) the first training step (loss, gradients, new running statistics) equals PyTorch's on the
    original network (BatchNorm kept; and with every BatchNorm frozen in inference form, fused
    or kept); for a fused file calibrated on images, the training-form forward on those images
    equals the imported inference forward, and on other images of the task it is near
    PyTorch's training forward (the file keeps no trace of PyTorch's running statistics: the
    calibration estimates them);
(b) steps at learning rate 0 leave held-out accuracy unchanged;
(c) a short fine-tune on digits 5-9 follows PyTorch's loss curve.

MobileNetV2 is checked with BatchNorm in training form (kept and fused); both networks with
BatchNorm frozen; the command line with MobileNetV1.
"""

import functools
import warnings

import numpy as np
import pytest
import tvm
from tvm import relax

from conftest import REFERENCE
from thomas_tune.training_graph import graph as G
from thomas_tune.compiler.compile import compile_graph
from thomas_tune.models import build, replace_head, spec
from thomas_tune.models.calibration import calibrate_batchnorms, identity_batchnorms
from thomas_tune.models.onnx_import import import_onnx
from thomas_tune.reference import TorchGraph, torch_module, torch_pretrain

torch = pytest.importorskip("torch")
pytest.importorskip("onnx")

RES = 64
ARCHS = {"mobilenet_v2": 0.35, "mobilenet_v1": 0.25}
# the trainable sets the tests compile (float64, llvm), chosen for compile time: BatchNorm in
# training form with MobileNetV2's last 2 layers training (its every-layer module takes 3x
# longer to compile; every layer and MobileNetV1 are fine-tuned in bench/four_levels.py
# --imported); frozen BatchNorm with MobileNetV2's last 2 layers and MobileNetV1's every layer
TRAINABLE = {"mobilenet_v2": "last:2"}
BATCH = 8
LR = 0.01


class Pretrained:
    """A network pretrained in PyTorch, its ONNX files and the data of both tasks."""

    def __init__(self, arch, tmp, seed):
        from thomas_tune.data import Dataset, load
        full = load("mnist5k", RES)

        def task(classes):
            keep = np.isin(full.y, classes)
            y = np.searchsorted(np.array(classes), full.y[keep])
            return Dataset(full.x[keep], y, [str(c) for c in classes], "mnist5k").split(
                0.2, seed=seed)

        self.train, self.test = task([0, 1, 2, 3, 4])
        self.ft_train, _ = task([5, 6, 7, 8, 9])
        self.model = build(arch, num_classes=5, resolution=RES, width=ARCHS[arch])
        self.tensors = torch_pretrain(self.model, self.train, steps=250, seed=seed)
        net = torch_module(self.model, self.tensors)
        x = torch.randn(1, 3, RES, RES)
        self.files = {"fused": str(tmp / f"{arch}-fused.onnx"),
                      "kept": str(tmp / f"{arch}-kept.onnx")}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch.onnx.export(net, (x,), self.files["fused"], dynamo=False)
            torch.onnx.export(net, (x,), self.files["kept"], dynamo=False,
                              training=torch.onnx.TrainingMode.PRESERVE)


@pytest.fixture(scope="session")
def pretrained(tmp_path_factory):
    seed = int(np.random.SeedSequence().entropy % (1 << 31))
    print(f"pretraining seed {seed}")
    tmp = tmp_path_factory.mktemp("pretrained")
    cache = {}

    def get(arch):
        if arch not in cache:
            cache[arch] = Pretrained(arch, tmp, seed)
        return cache[arch]

    return get


@pytest.fixture(scope="session")
def compiled():
    """The float64 training module (llvm) per (arch, trainable set), compiled once."""
    cache = {}

    def get(model, trainable, lr=LR):
        key = (model.arch, trainable, lr)
        if key not in cache:
            tg = G.training_module(model, BATCH, trainable, G.OptimizerConfig(lr=lr),
                                   dtype="float64")
            cache[key] = (tg, relax.VirtualMachine(compile_graph(tg.mod, REFERENCE),
                                                   tvm.cpu()))
        return cache[key]

    return get


@functools.lru_cache(maxsize=None)
def _spec(model):
    """``spec(model)``, a trace of the model: made once per model (a reference is made per
    batch below); not to be changed."""
    return spec(model)


def _t(a, dtype="float64"):
    a = np.asarray(a, dtype=dtype)
    return tvm.runtime.tensor(a if a.flags.c_contiguous else a.copy())


class Ours:
    """Training steps of the compiled float64 module from ``tensors``."""

    def __init__(self, tg, vm, tensors):
        self.tg, self.vm = tg, vm
        self.t = {k: _t(v) for k, v in tensors.items()}
        self.opt = [_t(a, a.dtype) for a in tg.optim_state]

    def step(self, x, y, masks, update=True):
        """One step: (loss, {trainable name: gradient}); parameters change when ``update``
        (the optimizer's learning rate is LR), running statistics always."""
        tg = self.tg
        ret, grads = self.vm[G.ADJOINT](
            _t(x), *[_t(masks[k]) for k in tg.masks],
            *[self.t[n] for n in tg.frozen + tg.trainable + tg.states], _t(y, "int64"))
        for n, v in zip(tg.states, list(ret)[1:]):
            self.t[n] = v
        if update:
            params, self.opt = self.vm[G.OPTIMIZER]([self.t[n] for n in tg.trainable], grads,
                                                    self.opt)
            for n, v in zip(tg.trainable, params):
                self.t[n] = v
        return float(ret[0].numpy()), {n: g.numpy() for n, g in zip(tg.trainable, grads)}

    def accuracy(self, data):
        s = _spec(self.tg.model)
        args = [self.t[q.name] for q in s.params + s.states]
        n = len(data.y) // BATCH * BATCH
        pred = np.concatenate([
            self.vm[G.PREDICT](_t(data.x[i:i + BATCH]), *args).numpy().argmax(1)
            for i in range(0, n, BATCH)])
        return float(np.mean(pred == data.y[:n]))


class Theirs:
    """The same steps in PyTorch float64 on the original network (momentum SGD, lr ``lr``)."""

    def __init__(self, model, tensors, trainable, frozen_bn=False, lr=LR):
        names = {q.name for q in _spec(model).params}
        self.model, self.frozen_bn = model, frozen_bn
        self.p = {k: torch.tensor(np.asarray(v, "float64"), requires_grad=k in trainable)
                  for k, v in tensors.items() if k in names}
        self.st = {k: torch.tensor(np.asarray(v, "float64")) for k, v in tensors.items()
                   if k not in names}
        self.opt = (torch.optim.SGD([self.p[n] for n in trainable], lr=lr, momentum=0.9)
                    if trainable else None)

    def step(self, x, y, masks, update=True):
        g = TorchGraph(self.p, self.st, {k: torch.tensor(v) for k, v in masks.items()}, True,
                       self.frozen_bn)
        loss = torch.nn.functional.cross_entropy(
            self.model.forward(g, torch.tensor(x, dtype=torch.float64)), torch.tensor(y))
        if self.opt is not None:
            self.opt.zero_grad()
            loss.backward()
            if update:
                self.opt.step()
        self.st.update(g.new_states)
        return float(loss.detach()), {n: p.grad.numpy().copy() for n, p in self.p.items()
                                      if p.grad is not None}

    def accuracy(self, data):
        """Held-out accuracy in eval mode, on the images :meth:`Ours.accuracy` uses."""
        n = len(data.y) // BATCH * BATCH
        with torch.no_grad():
            g = TorchGraph(self.p, self.st, {}, False)
            logits = self.model.forward(g, torch.tensor(data.x[:n], dtype=torch.float64))
        return float(np.mean(logits.argmax(1).numpy() == data.y[:n]))


def _check_lr0(pre, model, tg, vm, tensors, theirs_tensors, rng, steps=10, drift=0.05):
    """(b): ``steps`` training steps at learning rate 0 on the pretraining task (only the
    running statistics move) leave the held-out accuracy where PyTorch's ends after the same
    steps in float64 from ``theirs_tensors`` (the network ``tensors`` was imported or
    calibrated to be), and within ``drift`` (5 points) of where it started, so that the
    comparison is made on a network that still classifies. PyTorch runs the BatchNorms of the
    frozen layers as ours does (``tg.frozen_bn``: in eval form, their statistics kept): with
    every BatchNorm in training form on its side only, the two accuracies parted by up to 0.6
    point on some draws of the batches. The running statistics of batches of 8 move both
    accuracies, by a pretraining- and batch-dependent amount (2.0 points for one pair of
    seeds)."""
    ours = Ours(tg, vm, tensors)
    theirs = Theirs(model, theirs_tensors, set(), frozen_bn=tg.frozen_bn)
    before = ours.accuracy(pre.test)
    assert before == theirs.accuracy(pre.test) and before > 0.8, before
    batches = pre.train.batches(BATCH, rng)
    for _ in range(steps):
        x, y = next(batches)
        masks = _masks(tg, rng)
        ours.step(x, y, masks, update=False)
        theirs.step(x, y, masks, update=False)
    after, want = ours.accuracy(pre.test), theirs.accuracy(pre.test)
    print(f"held-out accuracy {before:.4f} -> {after:.4f} (PyTorch {want:.4f})")
    assert after == want and abs(after - before) <= drift, (before, after, want)


def _torch_batchnorm_output_statistics(model, tensors, images, batch=64):
    """{BatchNorm name: (mean, biased variance)} per channel, float64, of every BatchNorm's
    output in PyTorch (float64, eval mode) on ``images`` (N, 3, R, R)."""
    ref = Theirs(model, tensors, set())
    sums = {}

    class Seen(TorchGraph):
        def batch_norm(self, name, x, eps=1e-5, momentum=0.1, act=None):
            y = super().batch_norm(name, x, eps, momentum)
            n, s1, s2 = sums.get(name, (0, 0.0, 0.0))
            sums[name] = (n + y.numel() // y.shape[1], s1 + y.sum((0, 2, 3)).numpy(),
                          s2 + (y * y).sum((0, 2, 3)).numpy())
            return self._activate(y, act)

    with torch.no_grad():
        for i in range(0, len(images), batch):
            model.forward(Seen(ref.p, ref.st, {}, False),
                          torch.tensor(images[i:i + batch], dtype=torch.float64))
    return {k: (s1 / n, s2 / n - (s1 / n) ** 2) for k, (n, s1, s2) in sums.items()}


def _masks(tg, rng):
    return {k: (rng.random(shape) >= p) / (1 - p) for k, (shape, p) in tg.masks.items()}


def _rel(got, ref):
    return float(np.abs(np.asarray(got) - ref).max() / max(np.abs(ref).max(), 1e-12))


@pytest.mark.parametrize("arch", sorted(TRAINABLE))
def test_kept_batchnorm_trains_as_pytorch(arch, pretrained, compiled, rng):
    """BatchNorm kept in the file: (a) the first step's loss, gradients and running statistics
    equal PyTorch's on the original network; (b) 10 steps at learning rate 0 end at PyTorch's
    held-out accuracy on the original network; (c) 5 fine-tuning steps on digits 5-9 follow
    PyTorch's losses."""
    pre = pretrained(arch)
    model, tensors, report = import_onnx(pre.files["kept"], arch, width=ARCHS[arch])
    assert not report.fused_batchnorms and not identity_batchnorms(model, tensors)
    tg, vm = compiled(model, TRAINABLE[arch])
    # the frozen layers' BatchNorms in inference form on both sides (the default of last:K)
    ours = Ours(tg, vm, tensors)
    theirs = Theirs(model, pre.tensors, set(tg.trainable), frozen_bn=tg.frozen_bn)
    batches = pre.ft_train.batches(BATCH, rng)
    for step in range(5):
        x, y = next(batches)
        masks = _masks(tg, rng)
        (l1, g1), (l2, g2) = ours.step(x, y, masks), theirs.step(x, y, masks)
        assert abs(l1 - l2) <= 1e-9 * max(1.0, l2), (step, l1, l2)
        if step == 0:
            for n in tg.trainable:
                assert _rel(g1[n], g2[n]) < 1e-7, n
            for n in tg.states:
                assert _rel(ours.t[n].numpy(), theirs.st[n].numpy()) < 1e-7, n

    _check_lr0(pre, model, tg, vm, tensors, pre.tensors, rng)


@pytest.mark.parametrize("arch", sorted(TRAINABLE))
def test_fused_batchnorm_calibrated_trains_as_pytorch(arch, pretrained, compiled, rng):
    """BatchNorm fused in the file, calibrated on images of the pretraining task: inference
    unchanged; on the calibration images the training-form forward equals the imported
    inference forward; (a) on 512 images, every calibrated BatchNorm holds the per-channel
    mean and variance of the original BatchNorm's output in PyTorch (float64, eval mode) on
    those images, and the first training loss is nearer PyTorch's on the original network
    than the uncalibrated import's (how near is a property of the pretrained network: how well
    its running statistics match the images' statistics); (b) 10 steps at learning rate 0 on
    the calibrated network end at PyTorch's held-out accuracy on it; (c) 5 fine-tuning steps
    on digits 5-9 follow PyTorch's losses."""
    pre = pretrained(arch)
    model, fused, report = import_onnx(pre.files["fused"], arch, width=ARCHS[arch])
    assert sorted(report.fused_batchnorms) == sorted(identity_batchnorms(model, fused))
    assert len(report.fused_batchnorms) == len([q for q in spec(model).states]) // 2
    # every BatchNorm in training form, frozen layers too (the calibration is about it)
    tg, vm = compiled(model, TRAINABLE[arch] + ",train-bn")

    # calibrated on exactly one batch: the training form on that batch is the inference form
    x, y = next(pre.train.batches(BATCH, rng))
    one, cal = calibrate_batchnorms(model, fused, x, batch=BATCH)
    assert cal.images == BATCH and cal.logits_change < 1e-5
    assert not identity_batchnorms(model, one)
    ours = Ours(tg, vm, one)
    ones = {k: np.ones(shape) for k, (shape, _) in tg.masks.items()}
    loss, _ = ours.step(x, y, ones, update=False)
    s = spec(model)
    logits = vm[G.PREDICT](_t(x), *[_t(one[q.name]) for q in s.params + s.states]).numpy()
    ref = float(torch.nn.functional.cross_entropy(torch.tensor(logits), torch.tensor(y)))
    assert abs(loss - ref) <= 1e-4 * max(ref, 0.1), (loss, ref)  # float32 statistics

    # calibrated on 512 images drawn at random from the pretraining task's training split
    pick = rng.permutation(len(pre.train.y))[:512]
    tensors, cal = calibrate_batchnorms(model, fused, pre.train.x[pick], batch=BATCH)
    assert cal.layers == identity_batchnorms(model, fused) and cal.images == 512
    assert cal.logits_change < 1e-5
    # the fused convolution's output is the original BatchNorm's inference output less the
    # fused bias: the calibration holds that output's mean (as the new bias) and variance
    # (float32 forward: errors measured in each channel's standard deviation)
    want = _torch_batchnorm_output_statistics(model, pre.tensors, pre.train.x[pick])
    worst = {}
    for n in cal.layers:
        mean, var = want[n]
        sd = np.maximum(np.sqrt(var), 1e-3 * np.sqrt(var).max())
        worst[n] = max(np.max(np.abs(tensors[f"{n}.bias"] - mean) / sd),
                       np.max(np.abs(tensors[f"{n}.running_mean"] - (mean - fused[f"{n}.bias"]))
                              / sd),
                       np.max(np.abs(tensors[f"{n}.running_var"] - var) / sd ** 2),
                       np.max(np.abs(tensors[f"{n}.weight"] - np.sqrt(var + 1e-5)) / sd))
    print("calibrated statistics against PyTorch's, worst layer",
          max(worst.items(), key=lambda kv: kv[1]))
    assert max(worst.values()) < 1e-3, worst
    losses = {"pytorch": [], "calibrated": [], "uncalibrated": []}
    for x, y in (next(pre.test.batches(BATCH, rng)) for _ in range(24)):
        masks = _masks(tg, rng)
        losses["pytorch"].append(Theirs(model, pre.tensors, set()).step(x, y, masks)[0])
        for name, t in (("calibrated", tensors), ("uncalibrated", fused)):
            losses[name].append(Ours(tg, vm, t).step(x, y, masks, update=False)[0])
    print("first training losses", losses)
    want = np.array(losses["pytorch"])
    gap = {k: float(np.abs(np.array(v) - want).mean() / want.mean()) for k, v in losses.items()}
    # near, not equal: the file keeps no trace of PyTorch's running statistics, which the
    # calibration replaces by the images' statistics (checked exactly above). How near depends
    # on the pretrained network (its seed is fresh) and on the batches: the uncalibrated gap
    # was 2.3x to 8.5x the calibrated one over 24 batches, the calibrated gap 0.1 to 0.63
    assert gap["uncalibrated"] > gap["calibrated"], gap

    # PyTorch on the calibrated network too: on the original network its running statistics
    # start elsewhere, and the two accuracies after 10 steps parted by 3 to 5 held-out images
    # of 496 on clean-clone runs, a property of the draw, not of the build
    _check_lr0(pre, model, tg, vm, tensors, tensors, rng)

    # (c) fine-tuning on digits 5-9 with a new head, from the calibrated weights on both
    # sides: the same network, batches and masks in float64, so the losses agree step by step
    # to rounding (1e-14 relative in two runs; a wrong gradient or update of the imported
    # network moves them by far more than the bound)
    head = {k: v for k, v in replace_head(model, tensors, 5, seed=int(rng.integers(99)))[1]
            .items() if k.startswith("classifier.")}
    ours = Ours(tg, vm, {**tensors, **head})
    theirs = Theirs(model, {**tensors, **head}, set(tg.trainable))
    batches = pre.ft_train.batches(BATCH, rng)
    curve = []
    for _ in range(5):
        x, y = next(batches)
        masks = _masks(tg, rng)
        curve.append((ours.step(x, y, masks)[0], theirs.step(x, y, masks)[0]))
    print("loss curve (ours, PyTorch)", curve)
    a, b = np.array(curve).T
    assert np.max(np.abs(a - b) / b) <= 1e-9, curve


FROZEN = {"mobilenet_v2": "last:2,frozen-bn", "mobilenet_v1": "all,frozen-bn"}
# Every layer of these briefly pretrained networks trained at LR with BatchNorm frozen can blow
# up within a few steps (PyTorch float64, MobileNetV1, one pretraining seed: loss 1.4 -> 32 in 7
# steps; another overflowed to NaN by step 5), in PyTorch as here; at 1e-3 the loss stayed
# under 3 for every seed tried. The comparison needs no large step.
FROZEN_LR = 1e-3


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_frozen_batchnorm_trains_as_pytorch_eval_batchnorm(arch, pretrained, compiled, rng):
    """Every BatchNorm frozen in inference form (``,frozen-bn``) against PyTorch with its
    BatchNorms in eval mode while the network trains: BatchNorm kept in the file, 5 steps
    with equal losses, gradients and unchanged running statistics; fused in the file and not
    calibrated, the first training loss equals PyTorch's within float32 rounding of the
    fused weights."""
    pre = pretrained(arch)
    model, kept, _ = import_onnx(pre.files["kept"], arch, width=ARCHS[arch])
    _, fused, _ = import_onnx(pre.files["fused"], arch, width=ARCHS[arch])
    tg, vm = compiled(model, FROZEN[arch], FROZEN_LR)
    assert tg.batchnorm == "frozen"
    ours = Ours(tg, vm, kept)
    theirs = Theirs(model, pre.tensors, set(tg.trainable), frozen_bn=True, lr=FROZEN_LR)
    batches = pre.ft_train.batches(BATCH, rng)
    for step in range(5):
        x, y = next(batches)
        masks = _masks(tg, rng)
        if step == 0:
            want, _ = Theirs(model, pre.tensors, set(), frozen_bn=True).step(x, y, masks)
            got, _ = Ours(tg, vm, fused).step(x, y, masks, update=False)
            assert abs(got - want) <= 1e-5 * max(want, 1e-2), (got, want)
        (l1, g1), (l2, g2) = ours.step(x, y, masks), theirs.step(x, y, masks)
        assert abs(l1 - l2) <= 1e-9 * max(1.0, l2), (step, l1, l2)
        for n in tg.trainable:
            assert _rel(g1[n], g2[n]) < 1e-7, (step, n)
    for n in tg.states:
        np.testing.assert_array_equal(ours.t[n].numpy(), np.asarray(kept[n], "float64"))
        # (PyTorch's start is its own float64 copy of the original network's statistics)
        np.testing.assert_array_equal(theirs.st[n].numpy(),
                                      np.asarray(pre.tensors[n], "float64"))


def test_cli_calibrates_and_trains_with_frozen_batchnorm(pretrained, tmp_path, capsys):
    """``import-onnx`` says the fused BatchNorms are identities and which way to fine-tune
    them, ``--calibrate`` says what it did and leaves none; ``train --trainable
    last:1,frozen-bn`` from the uncalibrated checkpoint warns that ',frozen-bn' is not the
    advised path for the last layers, and keeps every running statistic and frozen layer as
    imported."""
    from thomas_tune.cli import main
    from thomas_tune.models import load_checkpoint
    from thomas_tune.models.fused_advice import fused_import_advice
    pre = pretrained("mobilenet_v1")
    width = str(ARCHS["mobilenet_v1"])
    base = ["import-onnx", pre.files["fused"], "--model", "mobilenet_v1", "--width", width]
    assert main(base + ["--out", str(tmp_path / "raw.npz")]) == 0
    out = capsys.readouterr().out
    assert "imported as identity BatchNorms" in out, out
    assert all(line in out for line in fused_import_advice()), out
    assert main(base + ["--out", str(tmp_path / "cal.npz"), "--calibrate", "digits",
                        "--calibrate-images", "64"]) == 0
    out = capsys.readouterr().out
    assert "calibrated on 60 images of digits" in out, out  # 6 of each of 10 classes
    assert all(line in out for line in fused_import_advice()), out
    model, raw, _ = load_checkpoint(str(tmp_path / "raw.npz"))
    _, cal, _ = load_checkpoint(str(tmp_path / "cal.npz"))
    n_bn = len(spec(model).states) // 2
    assert len(identity_batchnorms(model, raw)) == n_bn and not identity_batchnorms(model, cal)

    train = ["train", "--checkpoint", str(tmp_path / "raw.npz"), "--classes", "10",
             "--data", "digits", "--limit", "200", "--steps", "3", "--quiet",
             "--save", str(tmp_path / "ft.npz"), "--out", str(tmp_path / "export")]
    assert main(train + ["--trainable", "last:1,frozen-bn"]) == 0
    err = capsys.readouterr().err
    assert "identity of a fused ONNX import: ',frozen-bn' on a fused import" in err, err
    assert fused_import_advice()[0] in err, err  # the last layers' case
    m10, ft, _ = load_checkpoint(str(tmp_path / "ft.npz"))
    assert m10.num_classes == 10
    for q in spec(model).states:
        np.testing.assert_array_equal(ft[q.name], raw[q.name])
    for q in spec(model).params:
        if q.block != "classifier":  # frozen: as imported
            np.testing.assert_array_equal(ft[q.name], raw[q.name])
