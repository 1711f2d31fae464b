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
    """Accuracies in [0, 1] on the held-out split; ms per training step (median, wall time)."""

    acc_before: float
    acc_after: float = 0.0
    steps: int = 0
    ms_per_step: float = 0.0
    losses: list[float] = field(default_factory=list)
    accuracy_curve: list[tuple[int, float]] = field(default_factory=list)


def fine_tune(session: Session, train: Dataset, test: Dataset, steps: int, seed: int = 0,
              eval_every: int = 0, show_progress: bool = True) -> TrainReport:
    """Run ``steps`` training steps on shuffled batches of ``train``; evaluate on ``test``
    before, every ``eval_every`` steps (0: never) and after."""
    rng = np.random.default_rng(seed)
    report = TrainReport(acc_before=session.evaluate(test.x, test.y))
    report.accuracy_curve.append((0, report.acc_before))
    times = []
    batches = train.batches(session.batch, rng)
    for step in tqdm(range(1, steps + 1), unit="step", disable=not show_progress):
        x, y = next(batches)
        t0 = time.perf_counter()
        report.losses.append(session.train_step(x, y))
        session.sync()
        times.append((time.perf_counter() - t0) * 1e3)
        if eval_every and step % eval_every == 0 and step != steps:
            report.accuracy_curve.append((step, session.evaluate(test.x, test.y)))
    report.steps = steps
    report.ms_per_step = float(np.median(times)) if times else 0.0
    report.acc_after = session.evaluate(test.x, test.y)
    report.accuracy_curve.append((steps, report.acc_after))
    return report
