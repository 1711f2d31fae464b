"""Exports shared by the tests of one session: :func:`export` builds a library once per set of
build inputs and copies it for every later test that asks for the same build.

An export's libraries (``inference.so``, ``train.so``), its optimizer state and its manifest
depend on the model (architecture and configuration), the target (host included), the
cross compiler (``TVM_NDK_CC``), the batch sizes, the trainable set, the optimizer, the default
rules, ``cache_features`` and the class names, never on the tensors: ``params.npz`` alone holds
them, and it is written fresh from each caller's tensors. So a test that draws fresh random
weights still runs them, and the build it runs is the one ``thomas_tune.compiler.export.export``
makes for its inputs (built once in this session by whichever test asked first).

The builds live under the session's temporary folder (shared by the pytest-xdist workers,
``tests/conftest.py`` sets :data:`ROOT`), one folder per key, made under a file lock so that
two workers asking for one build wait for one compile. Exports with a tuning log are not
shared (their record check is part of what such a test checks), nor is anything built under a
mutant (``tests/mutants.py`` changes the build without changing these inputs): call
``thomas_tune.compiler.export.export`` itself there.
"""

from __future__ import annotations

import dataclasses
import fcntl
import hashlib
import json
import os
import shutil

#: The folder of the session's shared builds (set by tests/conftest.py); None outside pytest,
#: where :func:`export` builds every time.
ROOT: str | None = None

MANIFEST = "manifest.json"
PARAMS = "params.npz"


def build_key(model, target, batch: int, infer_batch: int, trainable: str, optimizer,
              classes, stock_defaults: bool, cache_features: bool) -> str:
    """The hex digest naming one build: every input of the libraries and the manifest."""
    from thomas_tune.target import is_cross
    inputs = {"arch": model.arch, "config": model.config(), "target": str(target),
              "cross_cc": os.environ.get("TVM_NDK_CC") if is_cross(target) else None,
              "batch": batch, "infer_batch": infer_batch, "trainable": trainable,
              "optimizer": dataclasses.asdict(optimizer) if optimizer is not None else None,
              "classes": list(classes) if classes else None, "stock_defaults": stock_defaults,
              "cache_features": cache_features}
    return hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()[:24]


def export(out_dir: str, model, tensors, target, batch: int = 8, infer_batch: int = 1,
           trainable: str = "all", optimizer=None, classes=None, progress=print,
           stock_defaults: bool = False, cache_features: bool = False):
    """``thomas_tune.compiler.export.export`` without a tuning log (same arguments, same folder),
    the libraries built once per session for these inputs; ``params.npz`` written from
    ``tensors``. Returns the manifest (:meth:`thomas_tune.manifest.Manifest.read`)."""
    from thomas_tune.compiler.export import export as build
    from thomas_tune.models import save_checkpoint

    kw = dict(batch=batch, infer_batch=infer_batch, trainable=trainable, optimizer=optimizer,
              classes=classes, stock_defaults=stock_defaults, cache_features=cache_features)
    if ROOT is None:
        build(out_dir, model, tensors, target, progress=progress, **kw)
        return _manifest(out_dir)
    key = build_key(model, target, **kw)
    stored = os.path.join(ROOT, key)
    os.makedirs(ROOT, exist_ok=True)
    with open(stored + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one compile per key, the other worker waits
        if not os.path.exists(os.path.join(stored, MANIFEST)):
            shutil.rmtree(stored + ".tmp", ignore_errors=True)
            build(stored + ".tmp", model, tensors, target, progress=progress, **kw)
            os.replace(stored + ".tmp", stored)
        else:
            progress(f"build {key} of this session reused")
    os.makedirs(out_dir, exist_ok=True)
    for name in sorted(os.listdir(stored)):  # the manifest last: a folder with one is whole
        src, dst = os.path.join(stored, name), os.path.join(out_dir, name)
        if os.path.isdir(src):
            shutil.copytree(src, dst, dirs_exist_ok=True)
        elif name not in (MANIFEST, PARAMS):
            shutil.copy2(src, dst)
    save_checkpoint(os.path.join(out_dir, PARAMS), model, tensors, classes)
    shutil.copy2(os.path.join(stored, MANIFEST), os.path.join(out_dir, MANIFEST))
    return _manifest(out_dir)


def _manifest(out_dir: str):
    from thomas_tune.manifest import Manifest
    return Manifest.read(out_dir)
