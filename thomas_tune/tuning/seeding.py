"""Seeding a session from other tuning logs (``tune --seed-log``): their best records, measured
here."""

from __future__ import annotations

import itertools
import os
import sys

import tvm_ffi

from ..logs import LogDatabase, TuningLog
from ..schedules import anchor_key, before_postproc, plain_json, transferred
from .refine import _measure_variants
from .resized import family_and_extents, refitted, shape_distance


def open_seed_logs(paths: list[str], own: TuningLog) -> list[tuple[str, LogDatabase]]:
    """The seed logs ``paths`` (folders, packed or not) opened for reading only: their lines
    are checked without setting anything aside (bad ones are reported on stderr and skipped),
    nothing is ever written to them. Returns (path, database) pairs. Raises ValueError for a
    path that holds no tuning log, or that is ``own`` (the log tuned into)."""
    from ..logs import read_log
    out = []
    for path in paths:
        if os.path.abspath(path) == os.path.abspath(own.path):
            raise ValueError(f"--seed-log {path!r} is the tuning log of this run (--log); give "
                             "another log, or leave --seed-log out to resume this one")
        read_log(path)  # a clear error for a folder that holds no tuning log
        log = TuningLog(path)  # a packed log is read from its copy in the cache
        log.check(report_to=sys.stderr, set_aside=False)
        try:
            out.append((path, LogDatabase(log.workload_path, log.record_path)))
        except Exception as err:  # a workload line TVM cannot read: check() named it
            raise ValueError(f"--seed-log {path!r}: its workloads cannot be read ({err}); "
                             "fix it with 'thomas-tune log check' on a copy") from None
    return out


def refine_seeds(contexts, progress, database, target, runner, builder, seeds, top_k: int,
                 errors=None, measured=None, references=None) -> dict:
    """Measure on this run's device, as trials of its tasks, the ``top_k`` best records of
    each workload of the seed logs ``seeds`` (:func:`open_seed_logs`) that a task of
    ``contexts`` matches, and add the results to ``database`` (this device's log).

    A seed workload matches a task when it is the same kernel (structural hash and equality:
    its records apply as they are) or a twin of the same contraction (:func:`thomas_tune.
    schedules.anchor_key`: the same loops and shapes with other element-wise blocks around,
    such as a fused ReLU; its records rewritten by :func:`thomas_tune.schedules.transferred`).
    A task that neither matches takes, from the seed workloads of its :func:`.resized.family`
    (the same computation at other shapes: a pointwise convolution of other channel counts),
    the best record of each of the ``top_k`` nearest (:func:`.resized.shape_distance`),
    then their second best and so on, ``top_k`` in all, each trace replayed with its tile
    sizes refitted to this task's extents (:func:`.resized.refitted`).
    Each seed is postprocessed for this run's target (one the postprocessors reject is left
    out), checked against its task's reference and timed through the same runner and
    builder as the search's trials (:func:`.refine._measure_variants`); one that fails here
    is a failed trial, recorded with its reason. Seeds whose schedule the log already holds
    (``measured``: a resumed run) are not measured again. The seed logs are only read.

    Run before the search: MetaSchedule's evolutionary search draws its first population from
    each task's best records in the database, so seeds that win start the search. Arguments
    ``progress`` ... ``references`` as :func:`.refine.refine_unroll`'s. Returns its dict
    (``measured``, ``failed``, ``better``, ``seconds``) with ``unusable``: seed records whose
    trace does not apply to its workload here (another TVM, another graph), and ``resized``:
    candidates refitted from other shapes (before postprocessing; those it rejects are not
    measured)."""
    donors = _SeedDonors(seeds, top_k)
    out = _measure_variants(contexts, progress, database, target, runner, builder,
                            donors.candidates, errors, measured, references)
    out["unusable"] = donors.unusable
    out["resized"] = donors.resized
    return out


class _SeedDonors:
    """The workloads of the seed logs ``seeds`` indexed for one run, and the seed candidates
    of a task drawn from them (:meth:`candidates`): ``twins`` by contraction
    (:func:`thomas_tune.schedules.anchor_key` -> [(seed log, workload)]), ``families`` by
    computation (:func:`.resized.family_and_extents` -> [(seed log, workload, its extents, its
    structural hash)]). Counts ``unusable`` seed records (whose trace does not apply here)
    and ``resized`` candidates (refitted from other shapes)."""

    def __init__(self, seeds, top_k: int):
        self.seeds, self.top_k = seeds, top_k
        self.twins: dict[int, list[tuple[LogDatabase, object]]] = {}
        self.families: dict[str, list[tuple[LogDatabase, object, tuple[int, ...], int]]] = {}
        self.unusable = self.resized = 0
        for _, seed in seeds:
            for workload in seed.workloads:
                self._index(seed, workload)

    def _index(self, seed: LogDatabase, workload) -> None:
        try:
            key = anchor_key(workload.mod)
        except Exception:  # a kernel the block analysis cannot read: no twin
            key = None
        if key is not None:
            self.twins.setdefault(key, []).append((seed, workload))
        try:
            kin, sizes = family_and_extents(workload.mod)
        except Exception:  # a kernel TVMScript cannot print: no family
            return
        self.families.setdefault(kin, []).append(
            (seed, workload, sizes, int(tvm_ffi.structural_hash(workload.mod))))

    def top(self, seed: LogDatabase, workload) -> list:
        """The ``top_k`` best records of ``workload`` in ``seed`` ([] where its traces do not
        replay here: counted unusable)."""
        try:
            return seed.get_top_k(workload, self.top_k)
        except Exception:  # a trace that does not replay here
            self.unusable += 1
            return []

    def candidates(self, c, ctx, workload, best_s):
        """The seed traces of the task of ``ctx`` (the ``_measure_variants`` candidate
        generator's signature): the records of the same kernel, then its twins' rewritten;
        where there is none, those of the nearest shapes of its family, refitted."""
        own = int(tvm_ffi.structural_hash(ctx.mod))
        found = False
        for trace in itertools.chain(self._same_kernel(ctx.mod), self._twins(ctx.mod, own)):
            found = True
            yield trace
        if not found:
            yield from self._other_shapes(ctx.mod, own)

    def _same_kernel(self, mod):
        for _, seed in self.seeds:
            same = seed.find_workload(mod)  # (no commit: a seed log is never written)
            if same is not None:
                for rec in self.top(seed, same):
                    try:
                        trace = list(before_postproc(*plain_json(rec.trace.as_json())))
                    except TypeError:  # an object with no JSON form
                        self.unusable += 1
                        continue
                    yield trace

    def _twins(self, mod, own: int):
        key = anchor_key(mod)
        for seed, donor in self.twins.get(key, []) if key is not None else []:
            if int(tvm_ffi.structural_hash(donor.mod)) == own:
                continue
            for rec in self.top(seed, donor):
                try:
                    trace = transferred(rec.trace.as_json(), donor.mod, mod)
                except TypeError:
                    trace = None
                if trace is None:
                    self.unusable += 1
                else:
                    yield trace

    def _other_shapes(self, mod, own: int):
        """The best record of each of the ``top_k`` nearest workloads of ``mod``'s family
        (:func:`.resized.shape_distance`), then their second best and so on, ``top_k`` in all,
        refitted to ``mod``'s extents (:func:`.resized.refitted`)."""
        try:
            kin, here = family_and_extents(mod)
        except Exception:  # a kernel TVMScript cannot print: no family
            return
        near = sorted((d for d in self.families.get(kin, ()) if d[3] != own),
                      key=lambda d: shape_distance(d[2], here))[:self.top_k]
        ranked = [(donor, self.top(seed, donor)) for seed, donor, _, _ in near]
        picks = [(donor, recs[depth]) for depth in range(self.top_k)
                 for donor, recs in ranked if depth < len(recs)][:self.top_k]
        for donor, rec in picks:
            try:
                trace = refitted(rec.trace.as_json(), donor.mod, mod)
            except TypeError:
                trace = None
            if trace is None:
                self.unusable += 1
            else:
                self.resized += 1
                yield trace
