"""Fine-tuning loop over an exported training module, with accuracy before and after."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
from tqdm import tqdm

from .data import Dataset
from .runtime import Session


@dataclass
class TrainReport:
    """Accuracies in [0, 1] on the held-out split; ms per training step (median, wall time);
    ``train_s``: wall time of the training in s, evaluations left out, the features' one pass
    included; ``features_s`` and ``features_bytes``: that pass's wall time (s) and the bytes of
    features it keeps in host memory (0 without ``cache_features``); ``skipped_steps``: steps
    whose update a loss-scaled export skipped (non-finite gradients) and ``loss_scale`` its
    scale after the last step (0 and None for another export, :mod:`thomas_tune.loss_scale`)."""

    acc_before: float
    acc_after: float = 0.0
    steps: int = 0
    ms_per_step: float = 0.0
    train_s: float = 0.0
    features_s: float = 0.0
    features_bytes: int = 0
    skipped_steps: int = 0
    loss_scale: float | None = None
    losses: list[float] = field(default_factory=list)
    accuracy_curve: list[tuple[int, float]] = field(default_factory=list)


def fine_tune(session: Session, train: Dataset, test: Dataset, steps: int, seed: int = 0,
              eval_every: int = 0, show_progress: bool = True,
              cache_features: bool = False) -> TrainReport:
    """Run ``steps`` training steps on shuffled batches of ``train``; evaluate on ``test``
    before, every ``eval_every`` steps (0: never) and after (the full ``predict``).

    ``cache_features``: the frozen part's output is computed once per training image
    (:meth:`Session.features`, an export made with ``--cache-features``) and kept in this
    process's memory as float32, and each step trains the last layers on its batch's features
    (:meth:`Session.train_step_features`): the same batches, dropout masks and numbers as
    without, for data without random augmentation (each image is the same at every step).
    Held on the host, not the device: a step uploads its batch's features as it would its
    images (fewer bytes, for every cut of the shipped models), and the device holds one batch,
    not the data set's features. Raises ValueError for an export without the split."""
    if cache_features:
        session.feature_split()  # an export without it fails here, before any work
    rng = np.random.default_rng(seed)
    report = TrainReport(acc_before=session.evaluate(test.x, test.y))
    report.accuracy_curve.append((0, report.acc_before))
    times, eval_s = [], 0.0
    t_start = time.perf_counter()
    if cache_features:
        feats = session.features(train.x)
        report.features_s = time.perf_counter() - t_start
        report.features_bytes = int(feats.nbytes)
    batches = train.batch_indices(session.batch, rng)
    for step in tqdm(range(1, steps + 1), unit="step", disable=not show_progress):
        sel = next(batches)
        t0 = time.perf_counter()
        if cache_features:
            report.losses.append(session.train_step_features(feats[sel], train.y[sel]))
        else:
            report.losses.append(session.train_step(train.x[sel], train.y[sel]))
        session.sync()
        times.append((time.perf_counter() - t0) * 1e3)
        if eval_every and step % eval_every == 0 and step != steps:
            t0 = time.perf_counter()
            report.accuracy_curve.append((step, session.evaluate(test.x, test.y)))
            eval_s += time.perf_counter() - t0
    report.train_s = time.perf_counter() - t_start - eval_s
    report.steps = steps
    report.ms_per_step = float(np.median(times)) if times else 0.0
    report.acc_after = session.evaluate(test.x, test.y)
    if session.scaler is not None:
        report.skipped_steps, report.loss_scale = session.scaler.skipped, session.scaler.scale
    report.accuracy_curve.append((steps, report.acc_after))
    return report


def divergence(report: TrainReport, classes: int, held_out: int) -> list[str]:
    """Signs that a fine-tuning run diverged, as sentences (empty: none).

    - the loss is not finite;
    - the loss rose: the mean of the last tenth of the steps (at least 5) is above the mean
      of the first tenth (a run that learns lowers it; single batches are noisy, means of a
      tenth are not);
    - the held-out accuracy ends at chance: at most ``1/classes`` plus two binomial standard
      errors over the ``held_out`` images (``sqrt(p (1 - p) / n)``), and below the accuracy
      before (a run that starts at chance and stays there trained nothing: that is said too
      when it ran at least 50 steps). Runs of fewer than 20 steps are not judged on accuracy.
    """
    out = []
    losses = np.asarray(report.losses, "float64")
    if losses.size and not np.all(np.isfinite(losses)):
        first_bad = int(np.argmin(np.isfinite(losses)))
        return [f"the loss is not finite from step {first_bad + 1} on"]
    k = max(5, losses.size // 10)
    if losses.size >= 2 * k:
        first, last = float(losses[:k].mean()), float(losses[-k:].mean())
        if last > first:
            out.append(f"the loss rose: {first:.3f} over the first {k} steps, {last:.3f} over "
                       f"the last {k}")
    chance = 1.0 / max(1, classes)
    at_chance = chance + 2.0 * np.sqrt(chance * (1 - chance) / max(1, held_out))
    if report.steps >= 20 and report.acc_after <= at_chance and (
            report.acc_after < report.acc_before or report.steps >= 50):
        out.append(f"held-out accuracy ends at {100 * report.acc_after:.1f}%, chance for "
                   f"{classes} classes ({100 * chance:.1f}%; before: "
                   f"{100 * report.acc_before:.1f}%)")
    return out


def likely_cause(manifest) -> str:
    """The likely cause of a diverged run of the export of ``manifest`` (a
    :class:`thomas_tune.manifest.Manifest`: its optimizer, BatchNorm mode and frozen set), and
    what to try."""
    lr = manifest.optimizer.get("lr")
    frozen_bn = manifest.batchnorm == "frozen"
    all_layers = not manifest.frozen
    cause = (f"a learning rate ({lr:g}) too high for this network and trainable set: try half "
             f"of it, or fewer trainable layers (--trainable last:K)" if lr is not None else
             "a learning rate too high for this network and trainable set")
    if frozen_bn and all_layers:
        cause += ("; with every layer trainable and BatchNorm frozen (',frozen-bn') nothing "
                  "re-normalises the activations the changing weights produce: train "
                  "BatchNorm ('--trainable all'), or freeze the early layers ('last:K,frozen-bn')")
    return cause
