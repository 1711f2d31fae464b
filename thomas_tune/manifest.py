"""Names an export shares between the compiler side and the runtime side, and its manifest.

Kept apart from :mod:`thomas_tune.export` and :mod:`thomas_tune.graph` (which build Relax
graphs and compile them) so that loading and running an export imports no compiler part: a
process started with ``TVM_USE_RUNTIME_LIB=1`` reads manifests and calls the exported functions
by these names. ``export`` and ``graph`` re-export them under their old names.
"""

from __future__ import annotations

import os

from .files import read_json

MANIFEST = "manifest.json"
FORMAT = "thomas_tune.export/2"  # 2: dropout masks drawn on the device (draw_masks)

# functions of the exported libraries (``graph`` builds them, ``runtime.Session`` calls them)
PREDICT = "predict"
ADJOINT = "train_adjoint"
OPTIMIZER = "optimizer"
PACK_TRAINABLE = "pack_trainable"
PACK_OPTIMIZER_STATE = "pack_optimizer_state"
DRAW_MASKS = "draw_masks"
# with ``--cache-features``: the frozen part alone (images -> features) and the training step of
# the trainable part on features (``graph.training_module(..., features=True)``)
FEATURES = "features"
HEAD_ADJOINT = "train_head_adjoint"
# the training step in one function: ``ADJOINT`` and ``OPTIMIZER`` inlined into one, so that the
# gradients are buffers of the step rather than its outputs (``graph.add_train_step``)
TRAIN_STEP = "train_step"


def frozen_function(name: str) -> str:
    """The exported function that computes, once per load, what function ``name`` reads of its
    constant inputs (``thomas_tune.lift``; the manifest's ``frozen_slots``, ``features_slots``
    and ``predict_slots`` say how ``name`` takes its values)."""
    return f"{name}_frozen"


ADJOINT_FROZEN = frozen_function(ADJOINT)
TRAIN_STEP_FROZEN = frozen_function(TRAIN_STEP)
FEATURES_FROZEN = frozen_function(FEATURES)
PREDICT_FROZEN = frozen_function(PREDICT)


def lifted_values(out, slots: list[str], get=None) -> list:
    """The values a ``*_frozen`` function returned (``out``, a tuple; over RPC a handle whose
    items ``get(out, i)`` reads), one per empty slot of ``slots``."""
    n = slots.count("")
    return [get(out, i) for i in range(n)] if get is not None else list(out)


def slot_arguments(slots: list[str], named, values: list) -> list:
    """What a function with lifted inputs takes in its constants' place: per slot, ``named(s)``
    for the tensor ``s`` it takes as it is, or, for an empty slot, the next of ``values``
    (:func:`lifted_values`)."""
    lifted = iter(values)
    return [named(s) if s else next(lifted) for s in slots]

def read_manifest(export_dir: str) -> dict:
    """The manifest (``manifest.json``, a dict) of the export folder ``export_dir``.

    Raises ValueError when the folder holds no readable manifest (not an export, or one not
    complete yet: the manifest is written last) or one of another export format, saying to run
    ``thomas-tune export`` (again)."""
    path = os.path.join(export_dir, MANIFEST)
    manifest = read_json(path, f"{export_dir}: not a thomas_tune export ({{err}}); run "
                               "'thomas-tune export' first")
    if manifest.get("format") != FORMAT:
        raise ValueError(f"{path}: export format {manifest.get('format')!r}, but this "
                         f"thomas_tune reads {FORMAT!r}; export the model again with "
                         "'thomas-tune export'")
    return manifest
