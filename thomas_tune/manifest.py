"""Names an export shares between the compiler side and the runtime side, and its manifest.

Kept apart from :mod:`thomas_tune.export` and :mod:`thomas_tune.graph` (which build Relax
graphs and compile them) so that loading and running an export imports no compiler part: a
process started with ``TVM_USE_RUNTIME_LIB=1`` reads manifests and calls the exported functions
by these names. ``export`` and ``graph`` re-export them under their old names.
"""

from __future__ import annotations

import json
import os

MANIFEST = "manifest.json"
FORMAT = "thomas_tune.export/2"  # 2: dropout masks drawn on the device (draw_masks)

# functions of the exported libraries (``graph`` builds them, ``runtime.Session`` calls them)
PREDICT = "predict"
ADJOINT = "train_adjoint"
# what the step computes from the frozen parameters alone, computed once per load
# (``lift.lift_frozen``; the manifest's ``frozen_slots`` say how the step takes it)
ADJOINT_FROZEN = "train_adjoint_frozen"
# the same for the inference module's predict, whose parameters and states are all constant
# between loads and training steps (the manifest's ``predict_slots``)
PREDICT_FROZEN = "predict_frozen"
FEATURES_FROZEN = "features_frozen"  # and for ``features`` (the manifest's ``features_slots``)
OPTIMIZER = "optimizer"
PACK_TRAINABLE = "pack_trainable"
PACK_OPTIMIZER_STATE = "pack_optimizer_state"
DRAW_MASKS = "draw_masks"
# with ``--cache-features``: the frozen part alone (images -> features) and the training step of
# the trainable part on features (``graph.training_module(..., features=True)``)
FEATURES = "features"
HEAD_ADJOINT = "train_head_adjoint"


def read_manifest(export_dir: str) -> dict:
    """The manifest (``manifest.json``, a dict) of the export folder ``export_dir``.

    Raises ValueError when the folder holds no readable manifest (not an export, or one not
    complete yet: the manifest is written last) or one of another export format, saying to run
    ``thomas-tune export`` (again)."""
    path = os.path.join(export_dir, MANIFEST)
    try:
        with open(path) as f:
            manifest = json.load(f)
    except (OSError, json.JSONDecodeError) as err:
        raise ValueError(f"{export_dir}: not a thomas_tune export ({err}); run "
                         "'thomas-tune export' first") from err
    if manifest.get("format") != FORMAT:
        raise ValueError(f"{path}: export format {manifest.get('format')!r}, but this "
                         f"thomas_tune reads {FORMAT!r}; export the model again with "
                         "'thomas-tune export'")
    return manifest
