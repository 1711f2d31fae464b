"""``thomas-tune bench``: one model, one device, side by side in one run.

Variants: the model compiled (a) with a tuning log ("tuned"), (b) with default schedules
("default"), (c) PyTorch eager on the same device class ("torch": CUDA when
``torch.cuda.is_available()``, else the CPU; skipped when torch is not installed), (d) with
``BenchConfig.torch_compile``, the same PyTorch step under ``torch.compile`` ("torch.compile":
compiled before timing, checked as the builds are, skipped with its cause where it cannot
compile: :mod:`.compiled`). For each:
ms per training step and per inference pass (median and interquartile range over ``steps``
interleaved rounds on fresh random inputs, after warm-up, by the host's clock and by the
device's timer: :mod:`.timing`), images/s, and the share of the device's measured peak FLOP/s
and bandwidth. For the compiled variants also:

- kernels: every kernel (PrimFunc) of the training step timed alone with ``time_evaluator``
  (device timer on OpenCL) on random inputs of its shapes; calls per step; GFLOP/s; whether
  the tuning log has a record for its workload. Their sum x calls against the measured step
  shows the overhead between kernels. Kernel launches per step are counted by the OpenCL
  sidecar.
- start-up: a fresh process loads the export and runs one training step, twice: with an empty
  OpenCL program-binary cache (first start: programs built from source) and with the cache the
  first start wrote (second start). That process imports TVM's runtime library only
  (``TVM_USE_RUNTIME_LIB=1``), as a deployed export runs.

The tuning curve (estimated kernel time of a training step against trials) replays the tuning
log's records in file order: a workload's time is its default-schedule time (measured here)
until a record beats it, x its calls per step. Peaks are measured once per device with kernels
of this package (:func:`.peaks.measure_peaks`) and cached in ``<cache>/peaks.json``.

Modules: :mod:`.run` (the whole bench), :mod:`.report` (its text tables), :mod:`.checks` (each
build's step against PyTorch before it is timed), :mod:`.exports` (the compiled variants, start-up,
counters), :mod:`.timing` (the builds timed side by side), :mod:`.kernels` (the kernel table),
:mod:`.peaks`, :mod:`.curve`, :mod:`.torch_baseline`, :mod:`.compiled` (PyTorch's step under
``torch.compile``).
"""

from .checks import check_variants, torch_float32_check
from .curve import plot_curve, tuning_curve
from .exports import prepare_exports, startup, time_export
from .kernels import Kernel, exported_training_module, mark_tuned, step_kernels, time_kernels
from .peaks import device_description, measure_peaks
from .report import format_report
from .run import BenchConfig, run_bench
from .timing import time_torch
from .torch_baseline import torch_device, torchvision_module

__all__ = [
    "BenchConfig", "Kernel", "check_variants", "device_description", "exported_training_module",
    "format_report", "mark_tuned", "measure_peaks", "plot_curve", "prepare_exports", "run_bench",
    "startup", "step_kernels", "time_export", "time_kernels", "time_torch", "torch_device",
    "torch_float32_check", "torchvision_module", "tuning_curve",
]
