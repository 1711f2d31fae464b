"""The default schedules of kernels, kept: in the process, and on disk for other processes.

The untuned and the tuned build of one training step share most kernels, and each kernel's
default schedule takes tens of milliseconds of dlight's rules; :func:`cached_schedule` makes
each once per kernel, rules and target (:mod:`thomas_tune.kept_ir`)."""

from __future__ import annotations

import functools
import hashlib
import os

import tvm

from ..kept_ir import kept


@functools.cache
def _rules_version() -> str:
    """sha256 of this folder's Python sources and TVM's version: what a kept schedule was made
    with (a change of either makes every kept schedule stale)."""
    h = hashlib.sha256(tvm.__version__.encode())
    here = os.path.dirname(os.path.abspath(__file__))
    for name in sorted(os.listdir(here)):
        if name.endswith(".py"):
            with open(os.path.join(here, name), "rb") as f:
                h.update(name.encode() + b"\0" + f.read())
    return h.hexdigest()


def _schedule_dir() -> str | None:
    """The folder of kept default schedules in the project's cache folder
    (:func:`thomas_tune.opencl.cache_dir`: ``$THOMAS_TUNE_CACHE``, else
    ``~/.cache/thomas_tune``): ``default_schedules``; None when
    ``THOMAS_TUNE_SCHEDULE_CACHE=off`` (schedules are then kept for the process only)."""
    if os.environ.get("THOMAS_TUNE_SCHEDULE_CACHE") == "off":
        return None
    return "default_schedules"


def cached_schedule(func: tvm.tirx.PrimFunc, target: tvm.target.Target, rule_classes,
                    schedule) -> tvm.tirx.PrimFunc | None:
    """``schedule(func, target, rule_classes)``, kept per kernel: in this process, and on disk
    (:func:`_schedule_dir`) for other processes (:func:`thomas_tune.kept_ir.kept`). The key
    holds the rules' version (:func:`_rules_version`), their names, the target and the kernel's
    TVM JSON, so a kept schedule is only reused for the same kernel under the same rules. A
    kernel the rules leave unscheduled (None) is not kept."""
    names = ",".join(f"{r.__module__}.{r.__qualname__}" for r in rule_classes)
    parts = [_rules_version(), names, str(target), tvm.ir.save_json(func)]
    return kept(_schedule_dir(), parts, lambda: schedule(func, target, rule_classes))
