"""TVM objects made once and kept: in the process, and on disk for other processes.

Some IR costs seconds to make and is made again and again from the same inputs: a
multi-tensor optimizer kernel parsed from its TVMScript text (about half a second for a kernel
of 128 buffers, :mod:`thomas_tune.training_graph.multi_tensor`) is the same kernel in every
export of that model, trainable set and optimizer. :func:`kept` makes such an object once per
key and stores it as TVM's JSON in the project's cache folder, which loads in a few
milliseconds (``tvm_ffi``'s JSON graph reader, without ``tvm.ir.load_json``'s upgrade of
older formats: every file was written by the pinned TVM, whose version is part of the key).
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Iterable

import tvm
from tvm_ffi.serialization import from_json_graph_str

from .files import write_atomically

_KEPT: dict[tuple[str | None, str], object] = {}  # (folder, key) -> object, this process's


def kept(folder: str | None, parts: Iterable[str], make: Callable[[], object | None]):
    """``make()``, kept per key: the sha256 of TVM's version and the strings ``parts`` (every
    input ``make`` depends on). Kept in this process and in ``folder`` of the project's cache
    folder (:func:`thomas_tune.opencl.cache_dir`; None: in this process only), one JSON file
    per key written atomically. A kept file that does not load is made again and rewritten;
    where the cache cannot be written (read-only, full) the object is kept for this process
    only; a ``make()`` that returns None is not kept. Raises what ``make`` raises."""
    from .opencl import cache_dir
    h = hashlib.sha256(tvm.__version__.encode())
    for part in parts:
        h.update(b"\0" + part.encode())
    key = h.hexdigest()
    if (folder, key) in _KEPT:
        return _KEPT[folder, key]
    path = os.path.join(cache_dir(), folder, key[:2], key + ".json") if folder else None
    if path is not None and os.path.exists(path):
        try:
            with open(path) as f:
                _KEPT[folder, key] = from_json_graph_str(f.read())
            return _KEPT[folder, key]
        except Exception:  # damaged or torn (TVM raises its own errors): make it again
            pass
    obj = make()
    if obj is None:
        return None
    _KEPT[folder, key] = obj
    if path is not None:
        try:
            write_atomically(path, tvm.ir.save_json(obj), sync=False)
        except OSError:
            pass
    return obj
