"""Traces in JSON form as plain Python values, and the schedule a trace plus postprocessors make."""

from __future__ import annotations

import json

import tvm


def json_default(o):
    """``json.dumps``'s ``default`` for the TVM objects of a trace's or a tuning record's JSON
    form (``as_json()``): ``IntImm`` and ``FloatImm`` as numbers, TVM maps and arrays as dicts
    and lists. Raises TypeError for an object that is none of these (not met in MetaSchedule's
    traces so far: a layout's ``IndexMap`` comes as a string)."""
    if isinstance(o, tvm.tirx.IntImm):
        return bool(o.value) if str(o.ty) == "bool" else int(o.value)
    if isinstance(o, tvm.tirx.FloatImm):
        return float(o.value)
    if isinstance(o, tvm.tirx.IndexMap):  # as TVM's own JSON form of a trace writes it
        return tvm.ir.save_json(o)
    if hasattr(o, "items"):
        return dict(o.items())
    if hasattr(o, "__len__") and hasattr(o, "__getitem__"):
        return list(o)  # TVM's arrays
    raise TypeError(f"{type(o).__name__} has no JSON form")


def plain_json(trace_json) -> list:
    """A trace's JSON form (``Trace.as_json()``: TVM arrays holding ``IntImm`` and ``FloatImm``
    attributes; or a record's, already plain) as plain Python lists, ints, floats and strings,
    which ``json`` can write and ``Trace.apply_json_to_schedule`` reads back. Raises TypeError
    as :func:`json_default` does."""
    return json.loads(json.dumps(trace_json, default=json_default))


def before_postproc(insts, decisions) -> tuple[list, list]:
    """A plain trace's instructions (each a list of its own) and decisions up to its
    postprocessing (``EnterPostproc``), which the postprocessors redo when applied again."""
    end = next((i for i, ins in enumerate(insts) if ins[0] == "EnterPostproc"), len(insts))
    return [list(ins) for ins in insts[:end]], [[i, d] for i, d in decisions if i < end]


def postprocessed(mod: tvm.IRModule, trace_json, postprocs,
                  seed: int | None = None) -> tvm.s_tir.Schedule | None:
    """The schedule of ``mod`` that a trace without postprocessing instructions (JSON form, as
    :func:`with_unroll` gives) and then ``postprocs`` make, its postprocessing marked so that a
    later replay can remove it; None when a postprocessor rejects it or cannot complete it.
    Sampling instructions without a decision in the trace draw one from the schedule's random
    state, ``seed`` (1 to 2^31 - 1; None: a random seed)."""
    sch = tvm.s_tir.Schedule(mod, seed=seed)
    try:
        tvm.s_tir.schedule.Trace.apply_json_to_schedule(trace_json, sch)
        sch.enter_postproc()
        if not all(p.apply(sch) for p in postprocs):
            return None
    except Exception:  # TVM's ScheduleError and friends: a schedule they cannot complete
        return None
    return sch
