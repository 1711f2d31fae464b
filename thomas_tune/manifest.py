"""Names an export shares between the compiler side and the runtime side, and its manifest.

The export format is :class:`Manifest`: :mod:`thomas_tune.compiler.export` makes one and writes it
(:meth:`Manifest.write`, last of the folder's files), and every reader takes it back with
:meth:`Manifest.read`, which refuses the manifest of another format version or a file that is no
export's manifest, saying to export again.

Kept apart from :mod:`thomas_tune.compiler.export` and :mod:`thomas_tune.training_graph.graph`
(which build Relax graphs and compile them) so that loading and running an export imports no
compiler part: a process started with ``TVM_USE_RUNTIME_LIB=1`` reads manifests and calls the
exported functions by these names. ``export`` and ``graph`` re-export them under their old names.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

from .files import read_json, write_json_atomically

MANIFEST = "manifest.json"
FORMAT_NAME = "thomas_tune.export"
# 2: dropout masks drawn on the device (draw_masks); 3: every field of Manifest present, the
# step function's slots under ``train_step_slots``; 4: ``loss_scale``
FORMAT_VERSION = 4
FORMAT = f"{FORMAT_NAME}/{FORMAT_VERSION}"

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
    constant inputs (``thomas_tune.training_graph.lift``; the manifest's ``frozen_slots``,
    ``features_slots`` and ``predict_slots`` say how ``name`` takes its values)."""
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


@dataclass(frozen=True)
class Manifest:
    """What an export folder holds and how its functions are called: ``manifest.json``, the
    export format (:data:`FORMAT`). On disk it is one JSON object with these fields under their
    own names, and ``format`` beside them. Parameter and state names are those of
    ``models.spec``; shapes are lists of ints (NCHW for images); a "slots" list names, per
    constant input of a built function, the tensor it takes as it is, or "" for the next value
    its ``NAME_frozen`` function returns (:func:`slot_arguments`); None where nothing of that
    function was lifted (it takes its constant inputs as they are)."""

    arch: str
    """The model's architecture (``models.ARCHITECTURES``: ``alexnet``, ``mobilenet_v1``, ...)."""
    config: dict
    """The model's configuration (``model.config()``: width, classes, input size, ...)."""
    input_shape: list[int]
    """The shape of ``predict``'s input batch of the inference library: (infer_batch, C, H, W)."""
    batch: int
    """Images per training step (the training library's batch)."""
    infer_batch: int
    """Images per call of the inference library's ``predict``."""
    target: dict
    """The TVM target the libraries were compiled for, as its JSON (``kind``, limits, host)."""
    target_name: str
    """The target in words (``thomas_tune.target.describe``)."""
    host_triple: str | None
    """The LLVM triple of the host the libraries are linked for (``aarch64-linux-android``,
    ``x86_64-pc-linux-gnu``, ...); None where it was not known."""
    params: list[str]
    """Every parameter of the model, in the model's order."""
    states: list[str]
    """Every state (BatchNorm running statistics) of the model, in the model's order."""
    trainable: list[str]
    """The parameters the step trains, in the order ``train_adjoint`` takes them."""
    frozen: list[str]
    """The parameters the step keeps, in the order ``train_adjoint`` takes them."""
    frozen_slots: list[str] | None
    """The frozen slots of ``train_adjoint``: per frozen parameter, itself or "" for the next
    value of ``train_adjoint_frozen``."""
    frozen_lift_inputs: list[str] | None
    """The tensors ``train_adjoint_frozen`` and ``train_step_frozen`` take, in order (the frozen
    parameters, then the running statistics of the BatchNorms in inference form); None where
    the step lifts nothing."""
    train_step_slots: list[str] | None
    """The frozen slots of ``train_step`` (the step in one function, which
    ``runtime.Session.train_step`` runs), as :attr:`frozen_slots`."""
    predict_slots: list[str] | None
    """The inference library's ``predict``: per parameter and state, itself or "" for the next
    value of ``predict_frozen``."""
    features_slots: list[str] | None
    """``features`` (with cached features): per frozen parameter and frozen state, itself or ""
    for the next value of ``features_frozen``; None without cached features."""
    batchnorm: str
    """The step's BatchNorm mode: ``frozen-part``, ``train`` or ``frozen``
    (``thomas_tune.trainable.BATCHNORM_MODES``)."""
    frozen_bn: list[str]
    """The BatchNorms the step runs in inference form (their running statistics constant),
    sorted."""
    masks: dict[str, dict]
    """The step's dropout masks in the order it takes them: name -> ``{"shape": [ints],
    "p": drop probability}``; empty for a model without dropout."""
    features: dict | None
    """The step split at the frozen part's output (``train --cache-features``):
    ``{"shape": one image's features, "frozen_states": [names], "head_states": [names]}``;
    None without it."""
    optimizer: dict
    """The optimizer (``graph.OptimizerConfig`` as a dict: ``kind``, ``lr``, ``momentum``,
    ``weight_decay``, ...)."""
    tuning_log: str | None
    """The path of the tuning log whose records were applied; None: default schedules."""
    tuning_log_sha256: str | None
    """The SHA-256 (hex) of the tuning log's workloads then records files; None without a log."""
    tuning_log_codegen: dict | None
    """The code-generation version of the log's times (``thomas_tune.logs.codegen``):
    ``{"status": "current" | ..., "id": stamp id or None}``; None without a log."""
    default_rules: str
    """The schedule rules of kernels without a record: ``thomas_tune`` or ``stock`` (TVM's)."""
    record_check: dict
    """The check of the applied records on this machine's device
    (``thomas_tune.compiler.build_plan.check_plan``): ``{"checked": count or None, "wrong":
    {workload: reason}, "unchecked": why none were checked, or None}``."""
    winograd: dict
    """The convolutions built in the Winograd form: ``{"inference": [...], "training": [...]}``,
    each a ``winograd_form.Conv`` as a dict (``Conv.from_dict`` reads it)."""
    classes: list[str] | None
    """The class names, index = class; None where none were given."""
    device: dict | None
    """The device limits the target was made from (``thomas_tune.target.device_limits``); None
    for a target given by name."""
    buffers: dict
    """The step's largest tensors and its peak (``thomas_tune.limits.step_buffers``):
    ``{"tensors": [{"name", "op", "shape", "bytes"}, ...], "peak_bytes": bytes}``."""
    precision: str
    """The step's precision: ``float32``, ``mixed16`` (layer outputs stored as float16,
    ``thomas_tune.half_storage``) or ``autocast16`` (float16 arithmetic where autocast has
    it, ``thomas_tune.half_arith``)."""
    memory_budget: dict | None
    """The memory budget's plan (``budget_bytes``, ``level``, ``estimated_peak_bytes``,
    ``saved_bytes``, ``flops_added``, ``recomputed``: names; bytes and FLOPs); None without a
    budget."""
    loss_scale: dict | None
    """Dynamic loss scaling of a step whose activation gradients are stored as float16 too
    (``--loss-scale dynamic``, :mod:`thomas_tune.half_grads`): ``{"kind": "dynamic",
    "init_scale", "growth_factor", "backoff_factor", "growth_interval"}``
    (:class:`thomas_tune.loss_scale.LossScale`); its step takes the scale after the labels and
    returns whether it skipped the update. None: activation gradients in float32, no scale."""

    def write(self, folder: str) -> str:
        """Write ``manifest.json`` into ``folder`` (through a temporary file and a rename, so
        the folder has a whole manifest or none); returns its path. Raises TypeError when a
        field holds a value JSON cannot write."""
        path = os.path.join(folder, MANIFEST)
        write_json_atomically(path, {"format": FORMAT, **dataclasses.asdict(self)})
        return path

    @classmethod
    def read(cls, folder: str) -> Manifest:
        """The manifest of the export folder ``folder``.

        Raises ValueError, naming the file and saying to run ``thomas-tune export`` (again):
        for a folder with no readable manifest (not an export, or one not complete yet: the
        manifest is written last), for a JSON file that is no thomas_tune export's manifest,
        and for the manifest of another format version (the version found and this one's)."""
        path = os.path.join(folder, MANIFEST)
        data = read_json(path, f"{folder}: not a thomas_tune export ({{err}}); run "
                               "'thomas-tune export' first")
        found = data.get("format") if isinstance(data, dict) else None
        name, _, version = str(found).partition("/")
        if not isinstance(found, str) or name != FORMAT_NAME:
            raise ValueError(f"{path}: not a thomas_tune export's manifest (format {found!r}, "
                             f"expected {FORMAT!r}); export the model with 'thomas-tune "
                             "export'")
        if version != str(FORMAT_VERSION):
            raise ValueError(f"{path}: export format version {version}, but this thomas_tune "
                             f"reads version {FORMAT_VERSION} ({FORMAT!r}); export the model "
                             "again with 'thomas-tune export'")
        fields = {f.name for f in dataclasses.fields(cls)}
        missing, extra = sorted(fields - set(data)), sorted(set(data) - fields - {"format"})
        if missing or extra:
            raise ValueError(f"{path}: a manifest of {FORMAT!r} without "
                             f"{', '.join(missing) or 'nothing'} and with "
                             f"{', '.join(extra) or 'nothing'} more: not written by this "
                             "thomas_tune; export the model again with 'thomas-tune export'")
        return cls(**{k: data[k] for k in fields})
