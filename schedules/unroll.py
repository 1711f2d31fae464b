"""Unroll limits: the steps the search chooses among, and traces edited to another limit."""

from __future__ import annotations

from .traces import before_postproc, plain_json


#: The maximum numbers of unrolled steps the search chooses among for a GPU kernel
#: (MetaSchedule's ``ParallelizeVectorizeUnroll``; loops are unrolled explicitly in the OpenCL C
#: source). On the H100 (``bench/experiments/compile_cost.py``, 48 AlexNet records,
#: ``bench/results/h100_alexnet_compile_cost.json``), limiting them to 64 cut TVM's build 3.2x
#: and NVIDIA's compile 3.5x per candidate, and made kernels 1.11x slower in the geometric mean
#: (1.20x for each workload's best record).
UNROLL_STEPS = (0, 16, 64, 512, 1024)


def unroll_steps(max_unroll: int | None = None) -> list[int]:
    """The choices of :data:`UNROLL_STEPS` up to ``max_unroll`` (all for None). Raises
    ValueError when that leaves fewer than two (below 16): MetaSchedule's unroll mutator
    needs another choice to move to."""
    if max_unroll is None:
        return list(UNROLL_STEPS)
    steps = [s for s in UNROLL_STEPS if s <= max_unroll]
    if len(steps) < 2:
        raise ValueError(f"max_unroll {max_unroll} leaves the search one unroll limit or none; "
                         f"give at least {UNROLL_STEPS[1]} (the limits are {UNROLL_STEPS})")
    return steps


def _unroll_at(insts, decisions) -> tuple[int, int] | None:
    """:func:`sampled_unroll` of a plain trace."""
    var = next((ins[1][1] for ins in insts if ins[0] == "Annotate" and ins[2]
                and ins[2][0] == "meta_schedule.unroll_explicit"), None)
    where = next((i for i, ins in enumerate(insts)
                  if ins[0] == "SampleCategorical" and ins[3] == [var]), None)
    chosen = dict((int(i), d) for i, d in decisions).get(where)
    if var is None or where is None or chosen is None:
        return None
    return where, int(insts[where][2][0][int(chosen)])


def sampled_unroll(trace_json) -> tuple[int, int] | None:
    """Where a trace (JSON form ``[instructions, decisions]``, plain or as ``Trace.as_json()``
    gives it) samples its unroll limit and the limit it chose: ``(instruction index, limit)``,
    or None when it samples none (the enumerated matmul tilings fix theirs)."""
    return _unroll_at(*plain_json(trace_json))


def _set_unroll(insts, decisions, found, step: int, choices: list[int]):
    """:func:`with_unroll` of a plain trace whose sampled limit is ``found``."""
    where, current = found
    if current == step and [int(c) for c in insts[where][2][0]] == choices:
        return None
    insts, decisions = before_postproc(insts, decisions)
    insts[where][2] = [choices, [1.0 / len(choices)] * len(choices)]
    decisions = [[i, d] for i, d in decisions if i != where]
    decisions.append([where, choices.index(step)])
    return [insts, decisions]


def with_unroll(trace_json, step: int, choices=UNROLL_STEPS):
    """A trace (JSON form, plain or as ``Trace.as_json()`` gives it) with its sampled unroll
    limit set to ``step``, its choice among ``choices`` (default all of :data:`UNROLL_STEPS`)
    and the postprocessing instructions dropped (apply it, then the postprocessors, to get the
    schedule). None when the trace samples no unroll limit (:func:`sampled_unroll`) or already
    chose ``step`` among ``choices``. Raises ValueError when ``step`` is not in ``choices``."""
    choices = [int(c) for c in choices]
    if step not in choices:
        raise ValueError(f"unroll step {step} is not one of {choices}")
    insts, decisions = plain_json(trace_json)
    found = _unroll_at(insts, decisions)
    return None if found is None else _set_unroll(insts, decisions, found, step, choices)


def within_unroll(trace_json, allowed) -> tuple[list | None, int | None]:
    """A trace (JSON form, plain or as ``Trace.as_json()`` gives it) kept to the unroll limits
    ``allowed`` (ascending, as :func:`unroll_steps` gives them): its sampled limit lowered to
    the largest allowed one not above it and its choice narrowed to ``allowed``, postprocessing
    dropped (:func:`with_unroll`). Returns ``(trace or None, limit it had)``: None for the
    trace when it chose among exactly ``allowed`` already; ``(None, None)`` when it samples no
    limit."""
    allowed = [int(a) for a in allowed]
    insts, decisions = plain_json(trace_json)
    found = _unroll_at(insts, decisions)
    if found is None:
        return None, None
    step = max(s for s in allowed if s <= max(found[1], allowed[0]))
    return _set_unroll(insts, decisions, found, step, allowed), found[1]
