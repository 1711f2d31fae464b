"""The trainable set of a training step: which parameters train, and how its BatchNorms run.

``--trainable`` names the trainable parameters (``all``, ``last:K``, or names) with an optional
suffix for the BatchNorm mode of the step (:data:`BATCHNORM_MODES`, described in
:mod:`thomas_tune.training_graph.graph`): ``,frozen-bn`` (every BatchNorm in inference form) or
``,train-bn`` (every BatchNorm in training form, frozen layers too); without one, ``frozen-part``.
"""

from __future__ import annotations

from .models import spec

BATCHNORM_MODES = ("frozen-part", "train", "frozen")
FROZEN_BN = "frozen-bn"  # suffix of a trainable set: "all,frozen-bn", "last:2,frozen-bn"
TRAIN_BN = "train-bn"  # suffix of a trainable set: "last:2,train-bn"
_SUFFIXES = {FROZEN_BN: "frozen", TRAIN_BN: "train"}



def parse_trainable(trainable: str) -> tuple[str, str]:
    """Split a ``--trainable`` value into (parameter set, BatchNorm mode; module docstring).

    ``"all"`` and ``"last:K"``: ``"frozen-part"`` (frozen layers' BatchNorms in inference
    form; with ``all`` there are none); a ``,train-bn`` suffix: ``"train"`` (every BatchNorm in
    training form); a ``,frozen-bn`` suffix: ``"frozen"`` (every BatchNorm in inference
    form). Raises ValueError for another suffix."""
    base, _, suffix = str(trainable).partition(",")
    if suffix and suffix not in _SUFFIXES:
        raise ValueError(f"--trainable {trainable!r}: the suffixes are ',{FROZEN_BN}' (every "
                         f"BatchNorm in inference form, e.g. 'all,{FROZEN_BN}') and "
                         f"',{TRAIN_BN}' (every BatchNorm in training form, frozen layers "
                         f"too, e.g. 'last:2,{TRAIN_BN}')")
    return base, _SUFFIXES.get(suffix, "frozen-part")


def select_trainable(model, trainable: str) -> list[str]:
    """Names of the trainable parameters for a ``--trainable`` value.

    ``all``: every parameter. ``last:K``: the parameters of the last K blocks (layers) in forward
    order; K must be in 1..number of blocks. A ``,frozen-bn`` suffix (:func:`parse_trainable`)
    does not change the set. Raises ValueError with the valid range otherwise.
    """
    s = spec(model)
    trainable, _ = parse_trainable(trainable)
    if trainable == "all":
        return [p.name for p in s.params]
    if trainable.startswith("last:"):
        try:
            k = int(trainable.split(":", 1)[1])
        except ValueError:
            k = -1
        if not 1 <= k <= len(s.blocks):
            raise ValueError(f"--trainable {trainable!r}: K must be 1..{len(s.blocks)} for "
                             f"{model.arch} (blocks: {', '.join(s.blocks)})")
        keep = set(s.blocks[-k:])
        return [p.name for p in s.params if p.block in keep]
    raise ValueError(f"--trainable {trainable!r}: use 'all' or 'last:K', optionally with "
                     f"',{FROZEN_BN}'")


def frozen_batchnorms(model, trainable: list[str], batchnorm: str) -> set[str]:
    """Names of the BatchNorms of ``model`` that a training step in mode ``batchnorm`` (module
    docstring) runs in inference form, for the trainable parameter names ``trainable``: none
    (``train``), every one (``frozen``), or those whose ``weight`` is frozen
    (``frozen-part``). Raises ValueError for another mode."""
    if batchnorm not in BATCHNORM_MODES:
        raise ValueError(f"BatchNorm mode {batchnorm!r}: use one of {BATCHNORM_MODES}")
    s = spec(model)
    names = {q.name[:-len(".running_mean")] for q in s.states
             if q.name.endswith(".running_mean")}
    if batchnorm == "train":
        return set()
    if batchnorm == "frozen":
        return names
    train = set(trainable)
    return {n for n in names if f"{n}.weight" not in train}
