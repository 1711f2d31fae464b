"""Failed trials with their reasons, appended to ``trial_errors.jsonl`` beside the records."""

from __future__ import annotations

import json
import os
import time

from tvm.ir.utils import derived_object
from tvm.s_tir import meta_schedule as ms

from .tuning_log import ERRORS, TuningLog


@derived_object
class TrialErrors(ms.measure_callback.PyMeasureCallback):
    """Measure callback appending each failed trial of a run to ``<log>/trial_errors.jsonl``:
    one JSON object per line, ``{"time", "task", "stage": "build"|"run", "reason"}`` (time in
    seconds since the epoch). ``count`` is the number written by this run."""

    def __init__(self, log: "TuningLog", task_names: list[str]):
        self.path = os.path.join(log.path, ERRORS)
        self.task_names = list(task_names)
        self.count = 0

    def apply(self, task_scheduler, task_id, measure_candidates, builder_results,
              runner_results) -> None:
        failed = []
        for b, r in zip(builder_results, runner_results):
            if b.error_msg is not None:
                failed.append(("build", str(b.error_msg)))
            elif r.error_msg is not None or not r.run_secs:
                failed.append(("run", str(r.error_msg or "no run time")))
        self._write([(self.task_names[task_id], stage, why) for stage, why in failed])

    def add(self, task: str, stage: str, reason: str) -> None:
        """Append one failed trial of ``task`` (``stage`` "build" or "run")."""
        self._write([(task, stage, reason)])

    def _write(self, failed: list[tuple[str, str, str]]) -> None:
        lines = []
        for task, stage, reason in failed:
            reason = [ln for ln in reason.strip().splitlines() if ln.strip()] or [""]
            lines.append(json.dumps({"time": round(time.time(), 3), "task": task,
                                     "stage": stage, "reason": reason[-1][:500]}) + "\n")
        if lines:
            with open(self.path, "a") as f:
                f.writelines(lines)
            self.count += len(lines)


def read_errors(log: "TuningLog") -> list[dict]:
    """The failed trials recorded in ``log`` (see :class:`TrialErrors`), oldest first."""
    path = os.path.join(log.path, ERRORS)
    if not os.path.exists(path):
        return []
    out = []
    with open(path) as f:
        for line in f:
            try:
                out.append(json.loads(line))
            except ValueError:  # a torn last line: the trial is still counted in the records
                continue
    return out
