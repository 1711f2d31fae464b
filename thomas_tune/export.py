"""Export: compile the inference and the training module with a tuning log and write them out.

An export folder holds::

    inference.so   predict(x, params..., states...) at the inference batch size
    train.so       train_adjoint, optimizer, and predict at the training batch size
    params.npz     the model's parameters and states (a models/ checkpoint)
    manifest.json  model, shapes, target, trainable/frozen sets, optimizer, tuning-log hash

Every file is written to a temporary name and renamed, manifest last, so a folder with a
manifest is complete.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import tempfile
import time

import numpy as np
import tvm

from . import graph as G
from .build import compile_graph
from .models import save_checkpoint, share_mode, spec
from .target import describe
from .tuning_log import TuningLog

MANIFEST = "manifest.json"
FORMAT = "thomas_tune.export/1"


def log_hash(log: TuningLog | None) -> str | None:
    """sha256 of the tuning log's two files (workloads, then records), or None without a log."""
    if log is None:
        return None
    h = hashlib.sha256()
    for path in (log.workload_path, log.record_path):
        if os.path.exists(path):
            with open(path, "rb") as f:
                h.update(f.read())
    return h.hexdigest()


def _atomic_write(path: str, write) -> None:
    folder = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=folder, suffix=os.path.splitext(path)[1])
    os.close(fd)
    try:
        write(tmp)
        share_mode(tmp, executable=path.endswith(".so"))
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def export(out_dir: str, model, tensors: dict[str, np.ndarray], target: tvm.target.Target,
           batch: int = 8, infer_batch: int = 1, trainable: str = "all",
           optimizer: G.OptimizerConfig | None = None, log: TuningLog | None = None,
           classes: list[str] | None = None, progress=print) -> dict:
    """Compile and write the export folder (see the module docstring); returns the manifest.

    ``tensors``: parameters and states (float32, shapes of ``models.spec``). ``batch``: images
    per training step. Raises ValueError for a bad trainable set or optimizer.
    """
    os.makedirs(out_dir, exist_ok=True)
    tg = G.training_module(model, batch, trainable, optimizer)
    database = log.database() if log is not None else None
    t0 = time.perf_counter()
    infer_exe = compile_graph(G.inference_module(model, infer_batch), target, database)
    progress(f"compiled inference module in {time.perf_counter() - t0:.1f} s")
    t0 = time.perf_counter()
    train_exe = compile_graph(tg.mod, target, database)
    progress(f"compiled training module in {time.perf_counter() - t0:.1f} s")
    _atomic_write(os.path.join(out_dir, "inference.so"), infer_exe.export_library)
    _atomic_write(os.path.join(out_dir, "train.so"), train_exe.export_library)
    save_checkpoint(os.path.join(out_dir, "params.npz"), model, tensors, classes)
    np.savez(os.path.join(out_dir, "optim_state.npz"),
             **{f"s{i}": a for i, a in enumerate(tg.optim_state)})
    s = spec(model)
    manifest = {
        "format": FORMAT,
        "arch": model.arch,
        "config": model.config(),
        "input_shape": list(model.input_shape(infer_batch)),
        "batch": batch,
        "infer_batch": infer_batch,
        "target": json.loads(str(target)),
        "target_name": describe(target),
        "params": [p.name for p in s.params],
        "states": [p.name for p in s.states],
        "trainable": tg.trainable,
        "frozen": tg.frozen,
        "masks": {k: {"shape": list(v[0]), "p": v[1]} for k, v in tg.masks.items()},
        "optimizer": dataclasses.asdict(tg.optimizer),
        "tuning_log": log.path if log is not None else None,
        "tuning_log_sha256": log_hash(log),
        "classes": classes,
    }
    _atomic_write(os.path.join(out_dir, MANIFEST),
                  lambda p: open(p, "w").write(json.dumps(manifest, indent=1)))
    return manifest


def read_manifest(export_dir: str) -> dict:
    """The manifest of an export folder; ValueError if the folder is not a complete export."""
    path = os.path.join(export_dir, MANIFEST)
    try:
        with open(path) as f:
            manifest = json.load(f)
    except (OSError, json.JSONDecodeError) as err:
        raise ValueError(f"{export_dir}: not a thomas_tune export ({err}); run "
                         "'thomas-tune export' first") from err
    if manifest.get("format") != FORMAT:
        raise ValueError(f"{path}: unknown export format {manifest.get('format')!r}")
    return manifest
