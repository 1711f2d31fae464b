"""The tuning log: MetaSchedule's JSON database on disk, checked before use.

A tuning log is a folder (by convention ``tuning_logs/<device>/<model>/``) with MetaSchedule's two
files: ``database_workload.json`` (one workload per line) and ``database_tuning_record.json``
(one tuning record per line: workload index, trace, run times, target, argument info).
MetaSchedule appends one line per measured trial and closes the file after each, so a killed run
loses at most the record in flight.

Before MetaSchedule reads the files, :meth:`TuningLog.check` parses every line. A line that does
not parse (a torn last line, a hand edit, a record whose workload is unreadable) is reported,
moved to ``<file>.rejected`` with the reason, and left out of the file MetaSchedule reads;
nothing is dropped silently.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from dataclasses import dataclass, field

import tvm_ffi
from tvm.s_tir import meta_schedule as ms
from tvm.s_tir.schedule import Schedule

from .models import share_mode

WORKLOADS = "database_workload.json"
RECORDS = "database_tuning_record.json"


@dataclass
class CheckReport:
    """Outcome of :meth:`TuningLog.check`: counts, and (file, line number, reason) of rejects."""

    workloads: int = 0
    records: int = 0
    rejected: list[tuple[str, int, str]] = field(default_factory=list)


def _rewrite(path: str, lines: list[str]) -> None:
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=os.path.dirname(path))
    with os.fdopen(fd, "w") as f:
        f.writelines(lines)
        f.flush()
        os.fsync(f.fileno())
    share_mode(tmp)
    os.replace(tmp, path)


class TuningLog:
    """A tuning-log folder. ``path`` is created on first use."""

    def __init__(self, path: str):
        self.path = path
        self.workload_path = os.path.join(path, WORKLOADS)
        self.record_path = os.path.join(path, RECORDS)

    def exists(self) -> bool:
        return os.path.exists(self.record_path)

    def check(self, report_to=sys.stderr) -> CheckReport:
        """Parse every line; move bad ones to ``<file>.rejected`` (see the module docstring).

        Records keep pointing at the right workload when a workload line is rejected (indices
        are renumbered). Returns a :class:`CheckReport`.
        """
        os.makedirs(self.path, exist_ok=True)
        report = CheckReport()
        new_index: dict[int, int] = {}
        good_workloads, bad_workloads = [], []
        if os.path.exists(self.workload_path):
            with open(self.workload_path) as f:
                for i, line in enumerate(f):
                    if not line.strip():
                        continue
                    try:
                        ms.database.Workload.from_json(json.loads(line))
                        new_index[i] = len(good_workloads)
                        good_workloads.append(line if line.endswith("\n") else line + "\n")
                    except Exception as err:  # JSON or TVM parse error: reject, keep the text
                        bad_workloads.append((i, line, f"bad workload: {err}"))
        good_records, bad_records = [], []
        if os.path.exists(self.record_path):
            with open(self.record_path) as f:
                for i, line in enumerate(f):
                    if not line.strip():
                        continue
                    try:
                        obj = json.loads(line)
                        idx, body = int(obj[0]), obj[1]
                        if idx not in new_index:
                            raise ValueError(f"workload #{idx} is missing or was rejected")
                        if not isinstance(body, list) or len(body) < 2:
                            raise ValueError("record body is not [trace, run_secs, ...]")
                        [float(s) for s in body[1]]
                        good_records.append(json.dumps([new_index[idx], body]) + "\n")
                    except Exception as err:
                        bad_records.append((i, line, f"bad record: {err}"))
        for path, bad in ((self.workload_path, bad_workloads), (self.record_path, bad_records)):
            if not bad:
                continue
            with open(path + ".rejected", "a") as f:
                for i, line, why in bad:
                    f.write(json.dumps({"line": i + 1, "reason": why, "text": line.rstrip("\n")})
                            + "\n")
                    report.rejected.append((os.path.basename(path), i + 1, why))
                    if report_to is not None:
                        print(f"tuning log {path}:{i + 1}: {why}; moved to {path}.rejected",
                              file=report_to)
        if bad_workloads:
            _rewrite(self.workload_path, good_workloads)
        if bad_workloads or bad_records:
            _rewrite(self.record_path, good_records)
        report.workloads, report.records = len(good_workloads), len(good_records)
        return report

    def database(self, check: bool = True) -> ms.database.JSONDatabase:
        """MetaSchedule's JSONDatabase over this folder (after :meth:`check` unless told not to)."""
        if check:
            self.check()
        return ms.database.JSONDatabase(self.workload_path, self.record_path, allow_missing=True)

    def measured(self, database: ms.Database, mod) -> set[int]:
        """Structural hashes of the schedules of ``mod`` (a task's workload) measured so far.

        Each record's trace is replayed on the workload; the hash of the result identifies the
        candidate as MetaSchedule's own de-duplication does.
        """
        if not database.has_workload(mod):
            return set()
        workload = database.commit_workload(mod)
        out = set()
        for rec in database.get_top_k(workload, 1 << 30):
            sch = Schedule(mod)
            try:
                rec.trace.apply_to_schedule(sch, remove_postproc=False)
            except Exception:  # a trace that no longer applies cannot be a duplicate
                continue
            out.add(tvm_ffi.structural_hash(sch.mod))
        return out

    def records_per_workload(self, database: ms.Database, mod) -> int:
        """Number of records with a valid run time for workload ``mod``."""
        if not database.has_workload(mod):
            return 0
        return len(database.get_top_k(database.commit_workload(mod), 1 << 30))
