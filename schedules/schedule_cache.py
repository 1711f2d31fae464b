"""The default schedules of kernels, kept: in the process, and on disk for other processes.

The untuned and the tuned build of one training step share most kernels, and each kernel's
default schedule takes tens of milliseconds of dlight's rules; :func:`cached_schedule` makes
each once per kernel, rules and target."""

from __future__ import annotations

import functools
import hashlib
import os

import tvm

from ..files import write_atomically

_SCHEDULED: dict[str, tvm.tirx.PrimFunc] = {}  # key -> scheduled kernel, for this process


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
    """The on-disk store of default schedules, ``default_schedules`` in the project's cache
    folder (:func:`thomas_tune.opencl.cache_dir`: ``$THOMAS_TUNE_CACHE``, else
    ``~/.cache/thomas_tune``); None when ``THOMAS_TUNE_SCHEDULE_CACHE=off`` (schedules are then
    kept for the process only)."""
    if os.environ.get("THOMAS_TUNE_SCHEDULE_CACHE") == "off":
        return None
    from ..opencl import cache_dir
    return os.path.join(cache_dir(), "default_schedules")


def _key(func: tvm.tirx.PrimFunc, target: tvm.target.Target, rule_classes) -> str:
    """sha256 (hex) of the rules' version (:func:`_rules_version`), the rule classes' names,
    the target and the kernel's TVM JSON."""
    h = hashlib.sha256()
    for part in (_rules_version(), ",".join(f"{r.__module__}.{r.__qualname__}"
                                            for r in rule_classes),
                 str(target), tvm.ir.save_json(func)):
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()


def cached_schedule(func: tvm.tirx.PrimFunc, target: tvm.target.Target, rule_classes,
                    schedule) -> tvm.tirx.PrimFunc | None:
    """``schedule(func, target, rule_classes)``, kept per kernel: in this process, and on disk
    (:func:`_schedule_dir`, one JSON file per kernel written atomically) for other processes.
    The key (:func:`_key`) holds the rules' version, their names, the target and the kernel,
    so a kept schedule is only reused for the same kernel under the same rules. A kept file
    that does not load is scheduled again and rewritten; a cache that cannot be written (read
    only, full) keeps the schedule for this process."""
    key = _key(func, target, rule_classes)
    if key in _SCHEDULED:
        return _SCHEDULED[key]
    folder = _schedule_dir()
    path = os.path.join(folder, key[:2], key + ".json") if folder else None
    if path is not None and os.path.exists(path):
        try:
            with open(path) as f:
                _SCHEDULED[key] = tvm.ir.load_json(f.read())
            return _SCHEDULED[key]
        except Exception:  # damaged or torn (TVM raises its own errors): make it again
            pass
    scheduled = schedule(func, target, rule_classes)
    if scheduled is None:
        return None
    _SCHEDULED[key] = scheduled
    if path is not None:
        try:
            write_atomically(path, tvm.ir.save_json(scheduled), sync=False)
        except OSError:  # a read-only or full cache: the schedule is kept for this process
            pass
    return scheduled
