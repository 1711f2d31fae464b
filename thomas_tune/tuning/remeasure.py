"""Measure a tuning log's best records again, on the device, and keep the new times.

A record's time is what one trial measured under the load of its tuning run. Where that load
made timings noisy (on the H100, before builds and compiles ran at low priority, small kernels
were timed at up to 15x), records and the default-schedule times they are compared with
(``default_latency.json``) carry that noise, and ``export`` may keep the wrong one. Here the
``top_k`` fastest valid records of each workload are built and timed again through the same
runner as tuning, and their run times in the log are replaced by the new ones: for one schedule
the latest measurement stands. The record file is rewritten atomically after each batch, under
the log's lock, so a killed run keeps the batches it finished and loses no record. A record
whose new measurement fails keeps its old time (the failure is reported).

A log of another or an unknown code-generation version (:mod:`thomas_tune.logs.codegen`) is
only re-measured whole (``restamp``): the re-measured records keep their new times, every other
record (not among the best, a failed trial, a failed re-measure) is moved to
``database_tuning_record.json.stale`` with the reason, and the log is stamped with this
installation's version. Nothing of the old times stays where it could be trusted.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

import tvm_ffi
from tvm.s_tir import meta_schedule as ms
from tvm.s_tir.schedule import Schedule

from ..measure.kept import keep_builder, take_builder
from .defaults import measure_kernels
from ..logs import TuningLog, mean_seconds, rewrite_atomically, set_aside, write_stamp


@dataclass
class RemeasureReport:
    """What :func:`remeasure` did: records timed again (``measured``), those whose new
    measurement failed (``failed``, with reasons), and per workload key the best time before
    and after, in seconds (``best``: ``{key: (before, after)}``)."""

    measured: int = 0
    failed: int = 0
    stale: int = 0
    reasons: dict[str, int] = field(default_factory=dict)
    best: dict[str, tuple[float, float]] = field(default_factory=dict)

    def changed(self, factor: float = 1.25) -> int:
        """Workloads whose best time moved by more than ``factor`` either way."""
        return sum(1 for a, b in self.best.values()
                   if math.isfinite(a) and math.isfinite(b) and max(a / b, b / a) > factor)


def _pick(bodies: list, keys: list[str], workload_keys: set[str] | None, top_k: int,
          report: RemeasureReport) -> tuple[dict[int, list[int]], list[int]]:
    """The valid record lines of each workload asked for, fastest first, and the ``top_k``
    fastest of each (line numbers); each workload's best time so far goes into ``report``."""
    by_workload: dict[int, list[int]] = {}
    for i, (w, body) in enumerate(bodies):
        if workload_keys is None or keys[w] in workload_keys:
            if math.isfinite(mean_seconds(body)):
                by_workload.setdefault(w, []).append(i)
    picked = []
    for w, idx in by_workload.items():
        idx.sort(key=lambda i: mean_seconds(bodies[i][1]))
        picked += idx[:top_k]
        report.best[keys[w]] = (mean_seconds(bodies[idx[0]][1]), math.inf)
    return by_workload, picked


def remeasure(log: TuningLog, target, runner: ms.Runner, workload_keys: set[str] | None = None,
              top_k: int = 2, batch: int = 64, builder_workers: int | None = None,
              progress=None, restamp: bool = False) -> RemeasureReport:
    """Time the ``top_k`` fastest valid records of each workload of ``log`` again on
    ``runner``'s device (compiled for ``target``) and write the new run times (seconds, one
    per repeat) into the log in place of the old.

    ``workload_keys``: only workloads whose key (structural hash, decimal, as
    :func:`thomas_tune.tasks.key`) is in it (None: all). Records are built and run in
    batches of ``batch``; ``progress(done, total)`` is called after each. ``restamp``: after
    the re-measure, every record not re-measured here (``stale`` counts them) is moved to
    :data:`~thomas_tune.logs.STALE` and the log is stamped with this installation's
    code-generation version
    (see the module docstring); without it the log must be of this version. Raises
    :class:`thomas_tune.logs.LogInUse` when a tuner holds the log, ValueError when the
    log has no records, :class:`thomas_tune.logs.CodegenMismatch` for a log of another
    version without ``restamp``; lines that do not parse are set aside as
    :meth:`TuningLog.check` does.
    """
    if not log.exists():
        raise ValueError(f"tuning log {log.path!r} has no records; tune first or fix the path")
    report = RemeasureReport()
    with log.lock("remeasuring"):
        was = log.version()
        if not restamp:
            log.require_version("re-measure part of it")
        log.check()  # bad lines set aside first: the line numbers below are of good lines
        with open(log.workload_path) as f:
            wl_lines = [line for line in f if line.strip()]
        workloads = [ms.database.Workload.from_json(json.loads(line)) for line in wl_lines]
        keys = [str(tvm_ffi.structural_hash(w.mod)) for w in workloads]
        with open(log.record_path) as f:
            lines = [line if line.endswith("\n") else line + "\n" for line in f if line.strip()]
        bodies = [json.loads(line) for line in lines]
        by_workload, picked = _pick(bodies, keys, workload_keys, top_k, report)
        fresh: list[int] = []  # lines measured again here
        builder = take_builder(builder_workers, timeout_s=120)
        try:
            for start in range(0, len(picked), batch):
                chunk = picked[start:start + batch]
                mods = []
                for i in chunk:
                    w, body = bodies[i]
                    rec = ms.database.TuningRecord.from_json(body, workloads[w])
                    sch = Schedule(workloads[w].mod)
                    rec.trace.apply_to_schedule(sch, remove_postproc=False)
                    mods.append(sch.mod)
                for i, (secs, why) in zip(chunk, measure_kernels(mods, target, runner,
                                                                 builder)):
                    if secs is None:
                        report.failed += 1
                        report.reasons[why] = report.reasons.get(why, 0) + 1
                        continue
                    w, body = bodies[i]
                    body[1] = secs
                    fresh.append(i)
                    lines[i] = json.dumps([w, body], separators=(",", ":")) + "\n"
                    report.measured += 1
                rewrite_atomically(log.record_path, lines)  # this batch's times are safe now
                if progress is not None:
                    progress(min(start + batch, len(picked)), len(picked))
        except BaseException:
            builder.shutdown()  # a build may still be running in it
            raise
        keep_builder(builder)  # for the next run of this process (measure.kept)
        for w, idx in by_workload.items():
            report.best[keys[w]] = (report.best[keys[w]][0],
                                    min(mean_seconds(bodies[i][1]) for i in idx))
        if restamp:
            keep = set(fresh)
            report.stale = set_aside(
                log.path, lines, (i for i in range(len(lines)) if i not in keep),
                f"not measured again when the log was restamped (it was measured with "
                f"{was.line()})")
            write_stamp(log.path, "remeasure --restamp")
    return report


