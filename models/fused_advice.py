"""Which way to fine-tune a network whose ONNX file had its BatchNorms fused, by trainable set
and learning rate: what ``import-onnx`` prints and what ``train`` warns about.

* last layers (``last:K``): the import as it is, BatchNorm in the default forms. The frozen
  layers run their BatchNorms in inference form, which on the import as it is computes the
  imported network exactly; a calibration on the new task's images changes what the trainable
  layers' training-form BatchNorms start from, and ``,frozen-bn`` keeps them the identity.
* every layer (``all``): calibrated on the images it will train on, BatchNorm in training form,
  which relearns each channel's scale and shift; at learning rates above ``STEADY_LR`` the runs
  of every path spread widely.

Source of the rules and of every figure below: ``python bench/fused_import.py``
(``bench/results/fused_import.md``): a MobileNetV2 (width 0.5, 64x64) pretrained in PyTorch on
MNIST digits 0-4, exported with BatchNorm fused, fine-tuned on digits 5-9 with a new head
(batch 8, momentum SGD 0.9), 3 seeds at lr 0.005 for 300 steps and at lr 0.01 for 150, each
path beside PyTorch fine-tuning the original network; the figures compare means of held-out
accuracy in percentage points.
"""

from __future__ import annotations

#: the learning rate up to which every layer, calibrated, ended level with PyTorch
STEADY_LR = 0.005

ADVICE = (
    "last layers (--trainable last:K): import without --calibrate (or calibrate on images of "
    "the pretraining task) and train with the default BatchNorm forms: the frozen layers run "
    "the imported network exactly; ended within 2 points of PyTorch fine-tuning the original "
    "network. Calibrating on the new task's images or adding ',frozen-bn' ended 4 to 7 points "
    "lower.",
    "every layer (--trainable all): import with --calibrate on your fine-tuning images and "
    f"train with BatchNorm in training form at lr {STEADY_LR:g} or below: ended level with "
    "PyTorch; the import as it is ended 1.5 to 6 points lower, ',frozen-bn' 4 to 10, "
    "calibration on the pretraining images 3 to 19. At lr 0.01 the runs of one path spread by "
    "up to 28 points (PyTorch's by 9).",
)


def fused_import_advice() -> list[str]:
    """The advice for a BatchNorm-fused import, one sentence per case (last layers, every
    layer), as ``import-onnx`` prints it; the figures are the module docstring's."""
    return list(ADVICE)


def fused_import_warning(batchnorm: str, all_layers: bool, lr: float | None) -> str | None:
    """What ``train`` says about a step on weights that hold the identity BatchNorms of a fused
    import (no ``--calibrate``), or None when the step is the advised one.

    ``batchnorm``: the export's BatchNorm mode (``frozen-part``, ``train`` or ``frozen``:
    :mod:`thomas_tune.training_graph.graph`); ``all_layers``: whether every parameter trains;
    ``lr``: the export's learning rate (None: unknown). The cases and figures are the module
    docstring's. Raises ValueError for another mode.
    """
    if batchnorm not in ("frozen-part", "train", "frozen"):
        raise ValueError(f"BatchNorm mode {batchnorm!r}: use frozen-part, train or frozen")
    if batchnorm == "frozen":
        return ("',frozen-bn' on a fused import trains the fused weights and keeps the "
                "trainable layers' identity BatchNorms: measured 4 to 6 points below "
                "'--trainable last:K' over the last layers, and 4 to 10 below a calibrated "
                "import in training form over every layer. " + _case(all_layers))
    if not all_layers and batchnorm == "train":
        return ("',train-bn' runs the frozen layers' identity BatchNorms in training form: "
                "they normalise by batch statistics, discard the imported scale and shift, and "
                "cannot learn them back. " + _case(all_layers))
    if not all_layers:
        return None
    out = ("over every layer, an import calibrated on your fine-tuning images ended 1.5 to 6 "
           "points higher: " + _case(all_layers))
    if lr is not None and lr > STEADY_LR:
        out += (f" This export's lr {lr:g} is above {STEADY_LR:g}: over every layer of a fused "
                "import, runs at lr 0.01 spread by up to 28 points, runs at "
                f"{STEADY_LR:g} with twice the steps by at most 8.")
    return out


def _case(all_layers: bool) -> str:
    """The advised path for the case, with the flag that takes it."""
    return ADVICE[1] if all_layers else ADVICE[0]
