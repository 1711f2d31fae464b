"""The kernel table: every kernel of an export's training step, timed alone."""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass, field

import numpy as np

from .peaks import seconds_per_call


@dataclass
class Kernel:
    """One PrimFunc of the training step: ``calls`` per step, FLOPs per call (TVM's estimate,
    multiply-adds count 2), ``bytes`` of its arguments per call (a lower bound of its memory
    traffic), the workload key (:func:`thomas_tune.tasks.key`), its argument shapes."""

    name: str
    calls: int
    flops: float
    bytes: int
    key: str
    args: list = field(default_factory=list)  # (shape, dtype) per parameter
    tuned: bool = False
    ms: dict = field(default_factory=dict)  # variant -> ms per call
    mod: object = field(default=None, repr=False)  # the workload (IRModule with "main")


def exported_training_module(tg):
    """The Relax module that :func:`thomas_tune.compiler.export.export` compiles into ``train.so``
    for the training graph ``tg`` (``graph.training_module``): kernel names in the library come from
    fusing exactly this module."""
    from ..training_graph.library_module import training_library_module
    return training_library_module(tg)[0]


def step_kernels(train_mod, winograd=None) -> list[Kernel]:
    """The kernels of one training step (``draw_masks`` where the module has it, then
    ``train_adjoint`` and ``optimizer``) of an unfused Relax training module
    (``graph.training_module(...).mod``, or :func:`exported_training_module`), fused as the
    build fuses it (``winograd``: the convolutions it computes in the Winograd form, as
    :func:`thomas_tune.compiler.compile.winograd_choice` gives them); sorted by FLOPs per step,
    largest first."""
    import tvm
    from tvm.s_tir.analysis import estimate_tir_flops
    from tvm.s_tir.meta_schedule.arg_info import ArgInfo

    from ..training_graph.graph import ADJOINT, OPTIMIZER
    from ..manifest import DRAW_MASKS
    from ..tasks import callees, fuse, workload_key, workload_module
    mod = fuse(train_mod, winograd)
    calls: dict[str, int] = {}
    names = {gv.name_hint for gv in mod.functions}
    for fname in (DRAW_MASKS, ADJOINT, OPTIMIZER):
        if fname not in names:
            continue
        for k, v in callees(mod[fname]).items():
            calls[k] = calls.get(k, 0) + v
    out = []
    for gv, func in mod.functions.items():
        if not isinstance(func, tvm.tirx.PrimFunc) or gv.name_hint not in calls:
            continue
        wmod = workload_module(func)
        try:
            flops = float(estimate_tir_flops(wmod))
        except Exception:  # int64 index math has no estimate: counted as 0
            flops = 0.0
        args, nbytes = [], 0
        for info in ArgInfo.from_prim_func(func):
            shape = tuple(int(v) for v in info.shape)
            dtype = str(info.dtype)
            args.append((shape, dtype))
            nbytes += int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
        out.append(Kernel(gv.name_hint, calls[gv.name_hint], flops, nbytes,
                          workload_key(func), args, mod=wmod))
    return sorted(out, key=lambda k: -k.flops * k.calls)


def mark_tuned(kernels: list[Kernel], log_path: str, target=None) -> int:
    """Set ``tuned`` on the kernels that the tuned build compiles with a record of the tuning
    log at ``log_path``: a workload with a valid record (matched by workload key, as the
    build's MetaScheduleApplyDatabase matches structurally), unless, given ``target``, its best
    record lost to the default schedule on the device
    (:func:`thomas_tune.compiler.compile.best_records`; such a kernel keeps its default). Returns
    how many are tuned."""
    from ..compiler.compile import best_records
    from ..logs import TuningLog
    best, slower = best_records(TuningLog(log_path).database(), log_path, target)
    used = set(best) - slower
    for k in kernels:
        k.tuned = k.key in used
    return sum(k.tuned for k in kernels)


def random_args(args, dev, rng, pool=None):
    """Device tensors of the given (shape, dtype) list: floats standard normal (views of
    ``pool``, a float32 normal sample drawn once per bench, when it is large enough), booleans
    fair coins, integers 0 or 1 (in range for every gather of the graphs: labels)."""
    import tvm
    out = []
    for shape, dtype in args:
        n = int(np.prod(shape, dtype=np.int64))
        if dtype.startswith("float"):
            if pool is not None and n <= pool.size:
                start = int(rng.integers(0, pool.size - n + 1))
                a = pool[start:start + n].reshape(shape).astype(dtype, copy=False)
            else:
                a = rng.standard_normal(shape).astype(dtype)
        elif dtype == "bool":
            a = rng.random(shape) < 0.5
        else:
            a = rng.integers(0, 2, shape).astype(dtype)
        out.append(tvm.runtime.tensor(np.array(a, dtype=dtype, order="C"), dev))
    return out


def time_kernels(library_path: str, kernels: list[Kernel], dev, variant: str,
                 min_ms: float = 1.0, seed: int = 0, progress: bool = True) -> None:
    """Time every kernel of ``kernels`` alone from the exported library ``library_path``
    (``train.so``): fresh random inputs of its argument shapes (floats normal, indices 0/1),
    one warm-up call, then the best of 3 repeats of at least ``min_ms`` ms of
    ``time_evaluator``. Stores ms per call in ``kernel.ms[variant]`` (NaN when the kernel is
    not in the library or fails, with the reason on stderr)."""
    import tvm
    from tqdm import tqdm
    lib = tvm.runtime.load_module(library_path)
    host = lib.imports[0] if lib.imports else lib
    rng = np.random.default_rng(seed)
    largest = max((int(np.prod(shape, dtype=np.int64)) for k in kernels for shape, dt in k.args
                   if dt.startswith("float")), default=0)
    pool = rng.standard_normal(2 * largest, dtype="float32") if largest else None
    for k in tqdm(kernels, desc=f"timing {variant} kernels", unit="kernel", disable=not progress,
                  leave=False):
        try:
            args = random_args(k.args, dev, rng, pool)
            k.ms[variant] = seconds_per_call(host, k.name, dev, args, min_ms) * 1e3
        except Exception as err:  # noqa: BLE001 (one kernel failing must not stop the bench)
            k.ms[variant] = math.nan
            print(f"bench: kernel {k.name} ({variant}) not timed: "
                  f"{str(err).strip().splitlines()[-1][:200]}", file=sys.stderr)
