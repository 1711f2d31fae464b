"""Local search near a task's best records: schedules that differ from one in one decision.

Coordinate descent over a trace's sampled decisions, as Droplet search does for tensor programs
(Canesche et al. 2024, "Droplet search: a coordinate-descent-based search for tensor program
optimization"): from the best schedule found, each neighbour changes one decision (a tile size
factor moved between two levels of one loop's tiling, another choice of a categorical decision
such as the unroll limit or a cooperative-fetch width, a compute location one loop up or down);
a neighbour that is faster becomes the next centre. Here the neighbours of a task's best records
share each batch with the evolutionary search (:class:`.search.ResumingSearch`), so the search
exploits what it found while it keeps exploring.
"""

from __future__ import annotations

import json
import random

import tvm_ffi
from tvm.s_tir import meta_schedule as ms

from ..schedules import before_postproc, plain_json, postprocessed


def _prime_factors(n: int) -> list[int]:
    out, p = [], 2
    while p * p <= n:
        if n % p == 0:
            out.append(p)
            while n % p == 0:
                n //= p
        p += 1
    if n > 1:
        out.append(n)
    return out


def _tile_neighbours(tiles: list[int], max_innermost: int) -> list[list[int]]:
    """Perfect tilings of the same extent as ``tiles`` with one prime factor moved from one
    level to another (the innermost kept at most ``max_innermost`` where that is positive)."""
    out = []
    for i, fi in enumerate(tiles):
        for p in _prime_factors(fi):
            for j in range(len(tiles)):
                if j == i:
                    continue
                new = list(tiles)
                new[i], new[j] = fi // p, new[j] * p
                if max_innermost > 0 and new[-1] > max_innermost:
                    continue
                out.append(new)
    return out


def decision_neighbours(insts: list, decisions: list) -> list[tuple[int, object]]:
    """Each ``(instruction index, decision)`` that changes one decision of a plain trace
    (:func:`thomas_tune.schedules.plain_json` form, postprocessing dropped) to a neighbouring
    value: ``SamplePerfectTile`` a prime factor moved between two levels (the innermost within
    the instruction's limit), ``SampleCategorical`` each other choice of non-zero probability,
    ``SampleComputeLocation`` the location one loop outward or inward. Other sampling
    instructions are left alone. Which of them a schedule accepts shows when it is applied."""
    out = []
    for idx, dec in decisions:
        kind, attrs = insts[idx][0], insts[idx][2]
        if kind == "SamplePerfectTile" and isinstance(dec, list):
            limit = int(attrs[1]) if len(attrs) > 1 else 0
            out += [(idx, new) for new in _tile_neighbours([int(d) for d in dec], limit)]
        elif kind == "SampleCategorical" and isinstance(dec, int):
            probs = attrs[1] if len(attrs) > 1 else []
            out += [(idx, k) for k, p in enumerate(probs) if k != dec and float(p) > 0]
        elif kind == "SampleComputeLocation" and isinstance(dec, int):
            out += [(idx, d) for d in (dec - 1, dec + 1) if d >= -2]
    return out


def with_decision(insts: list, decisions: list, index: int, decision) -> list:
    """The plain trace ``[insts, decisions]`` with the decision of instruction ``index`` set to
    ``decision``."""
    return [insts, [[i, decision if i == index else d] for i, d in decisions]]


def differing_decisions(trace_a, trace_b) -> list[int]:
    """The instruction indices whose decisions differ between two traces (JSON form, plain or
    as ``as_json()`` gives it), postprocessing left out; the instructions themselves must be
    the same up to ``EnterPostproc`` (else ValueError)."""
    ia, da = before_postproc(*plain_json(trace_a))
    ib, db = before_postproc(*plain_json(trace_b))
    if [i[:3] for i in ia] != [i[:3] for i in ib]:
        raise ValueError("the traces' instructions differ, not only their decisions")
    a, b = dict((i, json.dumps(d)) for i, d in da), dict((i, json.dumps(d)) for i, d in db)
    return sorted(i for i in set(a) | set(b) if a.get(i) != b.get(i))


class LocalSearch:
    """The neighbours of a task's best records, handed out a few at a time.

    ``mod``: the task's workload; ``postprocs``: its space generator's postprocessors;
    ``measured``: structural hashes of schedules measured or proposed (shared with the
    evolutionary search: a neighbour in it is not proposed, and those proposed are added);
    ``top``: best records of the task whose neighbours are searched, best first (a neighbour
    that beats them becomes the centre at the next call); ``rng``: order of the neighbours.
    ``tried`` maps a record's trace to the neighbours already built from it (not built again);
    ``counts`` gets ``local`` (neighbours proposed) and ``skipped``."""

    def __init__(self, mod, postprocs, measured: set[int], top: int = 2,
                 rng: random.Random | None = None, tried: dict | None = None,
                 counts: dict | None = None):
        self.mod, self.postprocs, self.measured, self.top = mod, list(postprocs), measured, top
        self.rng = rng or random.Random(0)
        self.tried = tried if tried is not None else {}
        self.counts = counts if counts is not None else {}

    def candidates(self, records: list, want: int) -> list:
        """Up to ``want`` measure candidates, each one decision away from one of ``records``
        (tuning records of the task, best first; the first :attr:`top` are used), none
        measured before."""
        out = []
        if want <= 0:
            return out
        args_info = ms.arg_info.ArgInfo.from_prim_func(self.mod["main"])
        for rec in records[: self.top]:
            try:
                insts, decisions = before_postproc(*plain_json(rec.trace.as_json()))
            except TypeError:  # an object with no JSON form: not searched from
                continue
            key = json.dumps([insts, decisions])
            tried = self.tried.setdefault(key, set())
            moves = [m for m in decision_neighbours(insts, decisions)
                     if json.dumps(m) not in tried]
            self.rng.shuffle(moves)
            for index, decision in moves:
                if len(out) >= want:
                    return out
                tried.add(json.dumps([index, decision]))
                sch = postprocessed(self.mod, with_decision(insts, decisions, index, decision),
                                    self.postprocs, seed=self.rng.randrange(1, 1 << 30))
                if sch is None:
                    continue
                h = tvm_ffi.structural_hash(sch.mod)
                if h in self.measured:
                    self.counts["skipped"] = self.counts.get("skipped", 0) + 1
                    continue
                self.measured.add(h)
                out.append(ms.MeasureCandidate(sch, args_info))
                self.counts["local"] = self.counts.get("local", 0) + 1
        return out
