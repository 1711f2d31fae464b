"""TVM's tensor intrinsics, imported with a shallow stack (a fifth of the time)."""

from __future__ import annotations

import inspect
import sys


def _shallow_stack(context: int = 1) -> list[inspect.FrameInfo]:
    """``inspect.stack(context)`` with the source context of the third frame only (the caller's
    caller), the only one TVMScript's parser reads; the others get none."""
    frame, out = sys._getframe(1), []
    while frame is not None:
        if len(out) == 2:
            tb = inspect.getframeinfo(frame, context)
            out.append(inspect.FrameInfo(frame, tb.filename, tb.lineno, tb.function,
                                         tb.code_context, tb.index, positions=tb.positions))
        else:
            out.append(inspect.FrameInfo(frame, frame.f_code.co_filename, frame.f_lineno,
                                         frame.f_code.co_name, None, None))
        frame = frame.f_back
    return out


def load_tensor_intrinsics() -> None:
    """Import TVM's tensor intrinsics (``tvm.s_tir.tensor_intrin``), which every MetaSchedule
    ``TuneContext`` imports, in a fifth of the time.

    That module parses 124 TVMScript functions, and TVM's ``prim_func`` decorator calls
    ``inspect.stack()`` for each. With source context for every frame, each call maps every
    frame to its module by a scan of ``sys.modules``: 27 s of a tuner's start on this project's
    2-core CI machine (58 s in a bare interpreter), paid by every process that tunes or builds a
    design space. The parser reads the source line of one frame (the third: is the function
    defined in a ``@I.ir_module`` class?) and the frame objects of the others, so during the
    import ``inspect.stack`` gives that frame's context alone (:func:`_shallow_stack`): 5 s.
    The intrinsics registered are the same (the structural hashes of all 124, compared once);
    ``inspect.stack`` is restored afterwards. A no-op once imported."""
    if "tvm.s_tir.tensor_intrin" in sys.modules:
        return
    real = inspect.stack
    inspect.stack = _shallow_stack
    try:
        import tvm.s_tir.tensor_intrin  # noqa: F401
    finally:
        inspect.stack = real
