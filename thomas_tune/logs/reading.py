"""Tuning logs read without changing them: their contents, a summary per workload, merging."""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass, field

import tvm_ffi

from .codegen import STAMP, read_version, write_stamp
from .database import mean_seconds
from ..files import write_atomically
from .tuning_log import RECORDS, WORKLOADS, TuningLog, parse_lines


@dataclass
class LogContents:
    """What :func:`read_log` found: ``workloads`` (one per good workload line: its JSON object
    and structural hash), ``records`` (workload position in ``workloads``, record body), and
    ``rejected`` ((file path, line number, reason) of lines that do not parse)."""

    path: str
    workloads: list[tuple[object, int]] = field(default_factory=list)
    records: list[tuple[int, list]] = field(default_factory=list)
    rejected: list[tuple[str, int, str]] = field(default_factory=list)


def read_log(path: str) -> LogContents:
    """Parse the tuning-log folder ``path`` without changing it (bad lines are listed in
    ``rejected`` with file and line). Raises ValueError when the folder holds no tuning log."""
    log = TuningLog(path)
    if not os.path.isdir(path) or not (os.path.exists(log.workload_path)
                                       or os.path.exists(log.record_path)):
        raise ValueError(f"{path!r} is not a tuning-log folder (no {WORKLOADS} or {RECORDS} "
                         "in it); give the folder that 'thomas-tune tune --log' wrote")
    lines = parse_lines(log.workload_path, log.record_path)
    out = LogContents(path)
    out.workloads = [(obj, int(tvm_ffi.structural_hash(wl.mod)))
                     for _, _, obj, wl in lines.workloads]
    out.records = [(w, body) for _, w, body in lines.records]
    out.rejected = ([(log.workload_path, i + 1, why) for i, _, why in lines.bad_workloads]
                    + [(log.record_path, i + 1, why) for i, _, why in lines.bad_records])
    return out


def _workload_label(bodies: list[list]) -> str:
    # the blocks the first trace instruction names and the shapes of the arguments: enough to
    # tell workloads apart in a listing without building anything
    blocks, shapes = [], ""
    for body in bodies:
        text = json.dumps(body[0])
        blocks = re.findall(r'"GetSBlock", \[\], \["([^"]+)"', text)
        if len(body) > 3:
            shapes = " ".join("x".join(str(d) for d in a[2]) for a in body[3]
                              if isinstance(a, list) and len(a) > 2)
        if blocks:
            break
    names = [b for b in dict.fromkeys(blocks) if b != "root"]
    return f"{'+'.join(names[:3]) or '?'} [{shapes}]"


def summarize(contents: LogContents) -> list[dict]:
    """Per workload of a read log: ``{"workload": position, "label", "hash", "records",
    "failed", "best_ms", "target"}`` (best_ms None when no trial succeeded), in the order of
    the workload file."""
    rows = []
    for w, (_, h) in enumerate(contents.workloads):
        bodies = [b for i, b in contents.records if i == w]
        times = [mean_seconds(b) for b in bodies]
        ok = [t for t in times if t < math.inf]
        kinds = sorted({str(b[2].get("kind")) for b in bodies
                        if len(b) > 2 and isinstance(b[2], dict)})
        rows.append({"workload": w, "label": _workload_label(bodies), "hash": h,
                     "records": len(bodies), "failed": len(bodies) - len(ok),
                     "best_ms": min(ok) * 1e3 if ok else None, "target": ",".join(kinds)})
    return rows


@dataclass
class MergeReport:
    """Outcome of :func:`merge`: workloads and records written, duplicates dropped, and the
    lines of the sources that did not parse (file, line, reason; left where they were)."""

    workloads: int = 0
    records: int = 0
    duplicates: int = 0
    rejected: list[tuple[str, int, str]] = field(default_factory=list)
    version: str = ""


def merge(sources: list[str], dest: str) -> MergeReport:
    """Merge the tuning logs ``sources`` (folders) into the folder ``dest``.

    Workloads are unified by structural hash; every distinct record (same workload, trace,
    run times, target and arguments) is kept once, so merging is idempotent and the logs of
    several devices or runs keep all their measurements. ``dest`` may be one of the sources
    or an existing log (its records come first). Sources are not changed; their bad lines are
    reported in ``rejected``. ``dest`` is written atomically under its lock. It keeps the
    code-generation stamp (:mod:`.codegen`) that all the merged logs share, and has none (an
    unknown version) when one of them is of another or an unknown version (``version`` says
    which, as a line). Raises ValueError
    for a source that is not a tuning log and :class:`LogInUse` when ``dest`` is in use.
    """
    target = TuningLog(dest)
    paths = list(sources)
    if target.exists() and os.path.abspath(dest) not in {os.path.abspath(p) for p in paths}:
        paths.insert(0, dest)
    contents = [read_log(p) for p in paths]  # all sources readable before anything is written
    report = MergeReport()
    with target.lock("merging"):
        wl_lines: list[str] = []
        wl_pos: dict[int, int] = {}
        seen: set[tuple[int, str]] = set()
        rec_lines: list[str] = []
        for c in contents:
            report.rejected.extend(c.rejected)
            local = []
            for obj, h in c.workloads:
                if h not in wl_pos:
                    wl_pos[h] = len(wl_lines)
                    wl_lines.append(json.dumps(obj) + "\n")
                local.append(wl_pos[h])
            for w, body in c.records:
                key = (local[w], json.dumps(body, sort_keys=True))
                if key in seen:
                    report.duplicates += 1
                    continue
                seen.add(key)
                rec_lines.append(json.dumps([local[w], body]) + "\n")
        write_atomically(target.workload_path, wl_lines)
        write_atomically(target.record_path, rec_lines)
        versions = [read_version(p) for p in paths]
        ids = {(v.stamp or {}).get("id") if v.status != "unknown" else None for v in versions}
        if len(ids) == 1 and None not in ids:
            write_stamp(dest, "merged", versions[0].stamp)
            report.version = read_version(dest).line()
        else:
            if os.path.exists(os.path.join(dest, STAMP)):
                os.remove(os.path.join(dest, STAMP))
            report.version = ("code generation unknown: the merged logs are of different or "
                              "unknown versions")
    report.workloads, report.records = len(wl_lines), len(rec_lines)
    return report
