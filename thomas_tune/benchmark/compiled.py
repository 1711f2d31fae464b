"""PyTorch with ``torch.compile`` as a side of the bench: compiled before timing, then checked."""

from __future__ import annotations

import time

#: most untimed calls of each kind (training step, inference pass) while compiling: the
#: optimizer's first two steps differ (momentum buffers created, then used), so its graphs are
#: complete after the second; a call that adds no graph ends the warm-up earlier
WARMUP_CALLS = 5


def compile_error(err: BaseException, device: str) -> str:
    """Why ``torch.compile`` failed, in one line: the innermost cause of ``err`` (its type and
    first line), with the fix where it is known (inductor compiles C++ for the CPU)."""
    inner = err
    while inner.__cause__ is not None:
        inner = inner.__cause__
    lines = [ln.strip() for ln in str(inner).splitlines() if ln.strip()]
    text = f"{type(inner).__name__}: {lines[0] if lines else ''}"[:300]
    if device == "cpu" and any(k in text for k in ("Cxx", "CppCompile", "C++ compiler")):
        text += (" (inductor builds C++ for the CPU: install a C++ compiler such as g++, or name "
                 "one in CXX)")
    return text


def _graphs() -> tuple[int, int]:
    """(graphs compiled, graph breaks) so far in this process, by TorchDynamo's counters."""
    from torch._dynamo.utils import counters
    return counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())


def compiled_side(model, tensors, trainable: list[str], optimizer, batch: int, infer_batch: int,
                  seed: int = 0, frozen_bn=frozenset(), reference: dict | None = None):
    """PyTorch's side of the bench with ``torch.compile``
    (:class:`~thomas_tune.benchmark.timing.TorchSide` with ``compiled=True``: the network,
    trainable set, frozen part and optimizer of the eager side), compiled and checked before
    it is timed.

    Compilation: training steps, then inference passes, untimed, until a call compiles no new
    graph (at most :data:`WARMUP_CALLS` of each); the parameters and BatchNorm statistics are
    then put back to those of ``tensors``. Check: with ``reference``
    (:func:`thomas_tune.step_check.reference_steps` of this model, parameters and trainable
    set), the compiled step's loss and every gradient on the check batches, dropout off,
    against PyTorch float64 with PyTorch float32's errors as the yardstick
    (:func:`~thomas_tune.benchmark.checks.check_torch_side`), and against a fresh PyTorch
    eager float32 step on the same batches.

    Returns (side or None, info): info has ``compile_s`` (host seconds of the untimed
    compiling calls), ``graphs`` and ``graph_breaks`` (TorchDynamo's counts over them),
    ``check`` and ``against_eager`` (StepChecks; None without ``reference``) or, where
    ``torch.compile`` cannot work here, side None and ``error`` (the cause,
    :func:`compile_error`). A compile that captured no graph (``TORCHDYNAMO_DISABLE=1``, say)
    is such a failure: an eager step is never reported as a compiled one. On CUDA the side's
    ``peak_bytes`` is ``torch.cuda.max_memory_allocated`` over the compiling training steps
    less what was allocated before the side was made (its network, gradients, optimizer state
    and the step's memory)."""
    from .checks import check_torch_side
    from .timing import TorchSide
    from .torch_baseline import torch_device
    dev_name = torch_device()
    if dev_name is None:
        return None, {"error": "PyTorch is not installed"}
    import torch
    import torch._dynamo
    torch._dynamo.config.suppress_errors = False  # a failed compile raises, never runs eager
    cuda = dev_name == "cuda"
    info = {}
    try:
        graphs0, breaks0 = _graphs()
        if cuda:
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
        side = TorchSide(model, tensors, trainable, optimizer, batch, infer_batch, seed,
                         frozen_bn=frozen_bn, compiled=True)
        # kept on the host: a copy on the device would count in the side's peak
        initial = {k: v.detach().to("cpu", copy=True) for k, v in side.net.state_dict().items()}
        t0 = time.perf_counter()
        for what in ("train", "infer"):
            side.begin(what)
            for i in range(WARMUP_CALLS):
                before = _graphs()[0]
                getattr(side, f"{what}_once")()
                if i > 0 and _graphs()[0] == before:
                    break
            if cuda and what == "train":  # this side's own: what others hold is left out
                side.peak_bytes = torch.cuda.max_memory_allocated() - base
        info["compile_s"] = time.perf_counter() - t0
        graphs, breaks = _graphs()
        info["graphs"], info["graph_breaks"] = graphs - graphs0, breaks - breaks0
        if info["graphs"] == 0:
            return None, {"error": "it captured no graph (TorchDynamo disabled: "
                                   "TORCHDYNAMO_DISABLE?), and an eager step is not timed as "
                                   "a compiled one"}
        with torch.no_grad():
            for k, v in side.net.state_dict().items():
                v.copy_(initial[k])
        side.begin("train")
        if cuda:
            side.cudnn_benchmark = torch.backends.cudnn.benchmark
        info["check"] = info["against_eager"] = None
        if reference is not None:
            eager = TorchSide(model, tensors, trainable, optimizer, batch, infer_batch, seed,
                              frozen_bn=frozen_bn)
            info["check"], info["against_eager"] = check_torch_side(side, reference, eager)
            del eager
    except RuntimeError as err:  # TorchDynamo's and inductor's errors are RuntimeErrors
        return None, {"error": compile_error(err, dev_name)}
    return side, info


def graphs_now() -> int:
    """Graphs TorchDynamo has compiled so far in this process (0 without PyTorch): a count
    that grows while a compiled side is timed means it compiled again inside the timing."""
    try:
        return _graphs()[0]
    except ImportError:
        return 0
