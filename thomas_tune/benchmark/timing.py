"""Builds timed side by side: one process, interleaved rounds, device timers, median and spread.

Every build of a bench (the tuned export, the default export, PyTorch) is loaded once; then each
round runs one training step of every build, in an order that rotates from round to round, so
that a drift of the machine (clocks, temperature, another process) falls on all of them alike.
Each step is timed twice: by the host's clock around it (the batch already on the device, the
result synchronised) and by the device itself, with OpenCL profiling events for an export
(the span from its first kernel's start to its last kernel's end, :func:`thomas_tune.opencl.
record_stop`) and a CUDA event pair for PyTorch on a GPU. Inference passes are timed the same
way after the training rounds. Each figure is reported as a median with its interquartile
range (first and third quartiles, numpy's linear interpolation)."""

from __future__ import annotations

import time

import numpy as np


def spread(samples_ms) -> dict:
    """Median, first and third quartile (ms) and count of ``samples_ms`` (a sequence of ms);
    all None for no samples."""
    a = np.asarray([s for s in samples_ms if s is not None], dtype=float)
    if a.size == 0:
        return {"median": None, "q1": None, "q3": None, "n": 0}
    q1, med, q3 = np.percentile(a, [25, 50, 75])
    return {"median": float(med), "q1": float(q1), "q3": float(q3), "n": int(a.size)}


class ExportSide:
    """A :class:`~thomas_tune.runtime.Session` on an export folder, one timed step at a time
    on fresh random batches (float32 images, integer labels) of ``seed``'s generator. The
    device timer is OpenCL's (profiling events of the step's kernels) for a local OpenCL
    session, none otherwise."""

    def __init__(self, export_dir: str, seed: int = 0):
        from ..runtime import Session
        self.session = s = Session(export_dir, seed=seed)
        self.rng = np.random.default_rng(seed)
        self.opencl = s.manifest.target["kind"] == "opencl" and not s.remote
        self.batch, self.infer_batch = s.batch, s.infer_batch

    def _images(self, n):
        return self.rng.standard_normal(self.session.model.input_shape(n)).astype("float32")

    def _timed(self, fn):
        from .. import opencl
        s = self.session
        s.sync()
        if self.opencl:
            opencl.record_start()
        t0 = time.perf_counter()
        fn()
        s.sync()
        wall = (time.perf_counter() - t0) * 1e3
        return wall, (opencl.record_stop()["span_ms"] if self.opencl else None)

    def train_once(self) -> tuple[float, float | None]:
        """One training step on a batch copied to the device before the clocks start (as
        PyTorch's is): (host ms, device ms or None)."""
        s = self.session
        x, y = s.upload(self._images(self.batch),
                        self.rng.integers(0, s.model.num_classes, self.batch))
        return self._timed(lambda: s.train_step(x, y))

    def begin(self, what: str) -> None:
        """Nothing to set before ``what`` ("train" or "infer"): the export's training and
        inference are functions of their own."""

    def infer_once(self) -> tuple[float, float | None]:
        """One inference pass (the export's inference batch; the copy of the images and of
        the logits included, as a caller pays them): (host ms, device ms or None)."""
        x = self._images(self.infer_batch)
        return self._timed(lambda: self.session.predict(x))


class TorchSide:
    """PyTorch float32 (TF32 off) of the same step, eager or with ``torch.compile``
    (``compiled``), one timed step at a time: see
    :func:`thomas_tune.benchmark.torch_baseline.torch_step` for the network, the frozen part
    and the optimizer. The device timer is a CUDA event pair on a GPU, none on the CPU."""

    def __init__(self, model, tensors, trainable, optimizer, batch: int, infer_batch: int,
                 seed: int = 0, use_torchvision: bool = True, frozen_bn=frozenset(),
                 compiled: bool = False):
        from .torch_baseline import torch_step
        self.__dict__.update(torch_step(model, tensors, trainable, optimizer, batch,
                                        infer_batch, seed, use_torchvision, frozen_bn,
                                        compiled))
        self.batch, self.infer_batch = batch, infer_batch

    def _timed(self, fn):
        torch, cuda = self.torch, self.dev.type == "cuda"
        if cuda:
            torch.cuda.synchronize()
            start, end = (torch.cuda.Event(enable_timing=True),
                          torch.cuda.Event(enable_timing=True))
            start.record()
        t0 = time.perf_counter()
        fn()
        if cuda:
            end.record()
            torch.cuda.synchronize()
        wall = (time.perf_counter() - t0) * 1e3
        return wall, (start.elapsed_time(end) if cuda else None)

    def train_once(self):
        """One training step (forward, cross-entropy, backward, optimizer step) on a batch
        already on the device: (host ms, device ms or None)."""
        x, y = self.new_batch()
        return self._timed(lambda: self.step(x, y))

    def begin(self, what: str) -> None:
        """Put the network in the modes of ``what`` before its rounds: "train" (the training
        step's modes) or "infer" (``eval()``), once, outside the timed passes."""
        if what == "train":
            self.training_mode()
        else:
            self.net.eval()

    def infer_once(self):
        """One inference pass (``eval()``, no grad: :meth:`begin`) on images already on the
        device."""
        x = self.new_images()
        return self._timed(lambda: self.infer(x))

    def choose_cudnn_benchmark(self, steps: int, warmup: int) -> dict:
        """On CUDA, time ``steps`` training steps with ``cudnn.benchmark`` off and on (it picks
        convolution algorithms by timing them; which setting is faster depends on the network)
        and keep the faster (by device time). Returns {"False": ms, "True": ms} (medians), {}
        on the CPU."""
        torch = self.torch
        if self.dev.type != "cuda":
            return {}
        by = {}
        self.begin("train")
        for setting in (False, True):
            torch.backends.cudnn.benchmark = setting
            for _ in range(warmup):
                self.train_once()
            by[setting] = spread([self.train_once()[1] for _ in range(steps)])["median"]
        torch.backends.cudnn.benchmark = min(by, key=by.get)
        self.cudnn_benchmark = torch.backends.cudnn.benchmark
        return {str(k): v for k, v in by.items()}


def time_interleaved(sides: dict, steps: int, warmup: int = 2) -> dict:
    """Time every side of ``sides`` (name -> :class:`ExportSide` or :class:`TorchSide`) in
    one process: ``warmup`` untimed rounds, then ``steps`` rounds of one training step of
    each, their order rotated every round; then the same for inference passes. Returns name
    -> {"train_wall": spread, "train_device": spread, "infer_wall": ..., "infer_device": ...}
    (:func:`spread`, ms; the device spreads have n = 0 where the side has no device timer)."""
    names = list(sides)
    out = {n: {} for n in names}
    for what in ("train", "infer"):
        samples = {n: [] for n in names}
        for n in names:
            sides[n].begin(what)
        for r in range(warmup + steps):
            k = r % len(names)
            for n in names[k:] + names[:k]:
                t = getattr(sides[n], f"{what}_once")()
                if r >= warmup:
                    samples[n].append(t)
        for n in names:
            out[n][f"{what}_wall"] = spread([w for w, _ in samples[n]])
            out[n][f"{what}_device"] = spread([d for _, d in samples[n]])
    return out


def as_result(timed: dict) -> dict:
    """One side's entry of :func:`time_interleaved` as a bench variant's keys: ``train_ms`` /
    ``infer_ms`` (host-clock medians), ``train_device_ms`` / ``infer_device_ms`` (device-timer
    medians, None without a device timer), and each one's spread under ``..._spread``."""
    out = {}
    for what in ("train", "infer"):
        wall, dev = timed[f"{what}_wall"], timed[f"{what}_device"]
        out[f"{what}_ms"], out[f"{what}_ms_spread"] = wall["median"], wall
        out[f"{what}_device_ms"], out[f"{what}_device_ms_spread"] = dev["median"], dev
    return out


def time_torch(model, tensors, trainable: list[str], optimizer, batch: int, infer_batch: int,
               steps: int, warmup: int = 2, seed: int = 0, use_torchvision: bool = True,
               frozen_bn: set[str] = frozenset()) -> dict:
    """PyTorch eager alone (the network, trainable set and optimizer of
    :func:`~thomas_tune.benchmark.torch_baseline.torch_step`), with
    ``cudnn.benchmark`` off and on on CUDA (the faster is kept, both are reported). ms per
    training step and per inference pass: medians over ``steps`` runs on fresh random
    batches already on the device, host clock (``train_ms``, ``infer_ms``) and CUDA events
    (``train_device_ms``, ``infer_device_ms``; None on the CPU), with their spreads
    (:func:`spread`). On CUDA, ``device_peak_bytes`` is
    ``torch.cuda.max_memory_allocated`` over the training steps (the network, its gradients,
    the optimizer state and the step's activations; None on the CPU). Raises RuntimeError
    when torch is not installed."""
    side = TorchSide(model, tensors, trainable, optimizer, batch, infer_batch, seed,
                     use_torchvision, frozen_bn)
    return torch_result(side, side.choose_cudnn_benchmark(steps, warmup),
                        time_interleaved({"torch": side}, steps, warmup)["torch"])


def torch_result(side, by_setting: dict, timed: dict) -> dict:
    """The result dict of PyTorch's side (see :func:`time_torch`) from its timings
    (:func:`time_interleaved`'s entry) and the medians by
    ``cudnn.benchmark`` setting. ``device_peak_bytes``: the side's ``peak_bytes`` where set
    (a peak taken before another PyTorch side of the process allocated), else
    ``torch.cuda.max_memory_allocated``; None on the CPU."""
    from .torch_baseline import torch_description
    cuda = side.dev.type == "cuda"
    peak = getattr(side, "peak_bytes", None)  # taken before another PyTorch side was made
    if cuda and peak is None:
        peak = side.torch.cuda.max_memory_allocated()
    return {**as_result(timed), "batch": side.batch, "infer_batch": side.infer_batch,
            "launches_per_step": None, "device_peak_bytes": peak, **torch_description(side),
            "train_ms_by_cudnn_benchmark": by_setting}
