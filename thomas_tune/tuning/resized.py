"""Schedules carried to a kernel of the same computation at other shapes.

A tuning record's trace fixes its tile sizes as decisions of ``SamplePerfectTile``, whose
factors must multiply to the loop's extent. A pointwise convolution of 512 to 512 channels at
14x14 and one of 320 to 1,280 channels at 7x7 are one computation at two shapes: the same
blocks, loops and index expressions, other extents. A trace of one replays on the other once
each tile decision is refitted to the new extent (:func:`refit_tile`), every other decision
(unroll limits, vector lanes, compute locations) kept. This is transfer-tuning's observation
(Gibson and Cano, "Transfer-Tuning: Reusing Auto-Schedules for Efficient Tensor Program Code
Generation", PACT 2022): schedules of one shape are good starting points at another, though
not the best; so a refitted trace is a seed to be measured, never a record applied unmeasured.

:func:`family` names the kernels a trace can be refitted between, :func:`shape_distance` says
how far apart two of them are, :func:`refitted` rewrites a trace.
"""

from __future__ import annotations

import math
import re

import tvm

from ..schedules import before_postproc, plain_json

#: a buffer argument in a PrimFunc's printed signature
_ARG = re.compile(r"(\w+): T\.Buffer")
#: the signature itself: ``def main(...)`` up to its colon, over several lines
_SIGNATURE = re.compile(r"def \w+\((.*?)\)(?: -> [^:]*)?:\n", re.S)
_NUMBER = re.compile(r"\d+")


def _normal_text(mod: tvm.IRModule) -> str:
    """``mod``'s ``main`` as TVMScript with its buffer arguments renamed by position (``arg_a``,
    ``arg_b``, ...): two workloads traced from different layers name their inputs after their
    layers (``lv139``, ``features_18_0_weight``)."""
    text = mod["main"].script()
    sig = _SIGNATURE.search(text)
    if sig is None:
        return text
    for i, name in enumerate(_ARG.findall(sig.group(1))):
        letters = "".join(chr(ord("a") + int(d)) for d in str(i))  # no digits: see family()
        text = re.sub(rf"\b{re.escape(name)}\b", f"arg_{letters}", text)
    return text


def family_and_extents(mod: tvm.IRModule) -> tuple[str, tuple[int, ...]]:
    """:func:`family` and :func:`extents` of ``mod`` from one printing of its TVMScript (the
    printing is most of their cost)."""
    text = _normal_text(mod)
    return _NUMBER.sub("#", text), tuple(int(n) for n in _NUMBER.findall(text))


def family(mod: tvm.IRModule) -> str:
    """The key shared by the kernels that are one computation at other shapes: ``mod``'s
    TVMScript with buffer arguments named by position and every integer written as ``#``
    (shapes, loop extents, strides, paddings, dtypes' bit widths, block-name suffixes). Two
    kernels with the same key have the same blocks (by name), loops and index expressions;
    the structures TVM prints differently, such as a stride of 1 (no multiplier) and one of 2,
    get different keys. A string (compare with ``==``; hash it for a dict)."""
    return family_and_extents(mod)[0]


def extents(mod: tvm.IRModule) -> tuple[int, ...]:
    """The integers :func:`family` abstracts, in the order they appear: two kernels of one
    family have as many, one for one."""
    return family_and_extents(mod)[1]


def shape_distance(a: tuple[int, ...], b: tuple[int, ...]) -> float:
    """How far apart two kernels of one family are: the sum over their :func:`extents` of
    ``|ln((x + 1) / (y + 1))|`` (0 for the same shapes; a channel count doubled adds ln 2).
    Raises ValueError when the tuples differ in length (not one family)."""
    if len(a) != len(b):
        raise ValueError("shape_distance: the kernels are not of one family")
    return sum(abs(math.log((x + 1) / (y + 1))) for x, y in zip(a, b))


def _divisor_at_most(n: int, limit: int) -> int:
    """The largest divisor of ``n`` that is at most ``limit`` (at least 1)."""
    best = 1
    for d in range(1, math.isqrt(n) + 1):
        if n % d == 0:
            for q in (d, n // d):
                if best < q <= limit:
                    best = q
    return best


def refit_tile(factors: list[int], extent: int) -> list[int]:
    """Tile factors for a loop of ``extent`` as close to ``factors`` (a decision of
    ``SamplePerfectTile`` for another extent; outermost first) as divisibility allows: from
    the innermost level out, each factor becomes the largest divisor of what is left of the
    extent that does not exceed it (thread counts and vector widths are inner levels, and
    keep their size where the extent allows), and the outermost takes the rest. The result
    multiplies to ``extent`` and no factor but the outermost grows, so a limit on the
    innermost factor still holds. ValueError for an extent below 1 or no factors."""
    if extent < 1 or not factors:
        raise ValueError(f"refit_tile: extent {extent}, factors {factors}")
    out, rest = [1] * len(factors), extent
    for i in range(len(factors) - 1, 0, -1):
        out[i] = _divisor_at_most(rest, max(1, int(factors[i])))
        rest //= out[i]
    out[0] = rest
    return out


def refitted(trace_json, donor: tvm.IRModule, mod: tvm.IRModule) -> list | None:
    """A trace of kernel ``donor`` (JSON form, a record's or ``Trace.as_json()``'s) replayed
    on kernel ``mod`` of the same :func:`family`, each ``SamplePerfectTile`` decision refitted
    to ``mod``'s loop (:func:`refit_tile`) and every other decision kept; its postprocessing
    instructions dropped (apply the trace, then the postprocessors). Returns the plain JSON
    form of ``mod``'s trace, or None when the trace does not replay on ``mod`` (a compute
    location or a split that the new extents rule out). The result is a schedule of ``mod``'s
    own computation: it can be slow, never wrong."""
    insts, decisions = before_postproc(*plain_json(trace_json))
    try:
        sch = tvm.s_tir.Schedule(donor)
        tvm.s_tir.schedule.Trace.apply_json_to_schedule([insts, decisions], sch)
        trace = sch.trace
        new = tvm.s_tir.Schedule(mod)

        def decide(inst, inputs, attrs, decision):
            if inst.kind.name != "SamplePerfectTile" or decision is None:
                return decision
            extent = new.get(inputs[0]).extent
            if not isinstance(extent, tvm.tirx.IntImm):
                return decision
            return refit_tile([int(f) for f in decision], int(extent.value))

        trace.apply_to_schedule(new, remove_postproc=True, decision_provider=decide)
        return list(before_postproc(*plain_json(new.trace.as_json())))
    except Exception:  # TVM's ScheduleError and friends: a step the new extents rule out
        return None
