"""The task scheduler of the tuner: which task gets the next batch of trials, and when to wait.

MetaSchedule's gradient scheduler (Zheng et al. 2020, "Ansor", section 6) waits for every
batch's measurements before it searches the next batch, so the host's evolutionary search and
candidate builds and the device's measurements take turns: on the H100 the device servers sat
idle while the host searched, and the host waited while the servers measured. Here the
device works on earlier batches while the host searches and builds the next one:
:class:`PipelinedGradient` keeps up to ``max_in_flight`` batches sent to the runner and, when
that bound is reached or every live task has a batch out, waits for whichever batch finishes
first and joins it. (Joining the oldest batch instead let one slow trial in it, such as a 20 s
OpenCL build, hold the host while the other servers ran out of trials: on the H100, with 12
servers and 4 batches in flight, the servers were busy 60-68% of the time and the host waited
for them 39-41% of it; joining the first to finish, 87% and 9%.)

Task choice follows the same gradient as MetaSchedule's ``GradientBased``: for task i with
best-latency history h (one entry per joined batch, ms) and weight w_i (calls per step),
``g_i = w_i * (alpha * (h[-1-W] - h[-1]) / W + (1 - alpha) * h[-1] / len(h))`` with window W.
The history starts from the task's default-schedule time when one was measured (``--time-share``):
a record only pays when it beats the default, so the default is the latency to improve on.
A task that already has records in the tuning log being resumed starts from its best record
as well and gets no first-round batch: the first round is for tasks never measured, and a
resumed task is chosen by its gradient like any other.
"""

from __future__ import annotations

import math
import random
import time

from tvm.ir.utils import derived_object
from tvm.s_tir import meta_schedule as ms

#: seconds between looks at the batches in flight while the host waits for one to finish
POLL_S = 0.01


def finished(order: list[int], tasks) -> list[int]:
    """The task ids in ``order`` (batches sent to the runner, oldest first) whose batch is over:
    every runner future of it is done, or the task sent none (its search ended). ``tasks``:
    MetaSchedule's task records (``runner_futures``: a list of futures with ``done()``, or None).
    """
    out = []
    for task_id in order:
        futures = tasks[task_id].runner_futures
        if futures is None or all(f.done() for f in futures):
            out.append(task_id)
    return out


@derived_object
class PipelinedGradient(ms.task_scheduler.PyTaskScheduler):
    """Gradient task scheduler that overlaps search and builds with measurement.

    ``default_ms``: per task (in the order of the tuning contexts), its default-schedule time
    in ms, or None where unknown; ``tuned_ms``: likewise, its best record's time in the tuning
    log being resumed, or None for a task with no record (such tasks alone get a first-round
    batch); ``alpha`` and ``window``: the gradient's parameters
    (MetaSchedule's defaults, 0.2 and 3); ``max_in_flight``: batches sent to the runner and not
    yet joined (1 gives MetaSchedule's order: search, build, measure, repeat).
    ``phases``: a :class:`thomas_tune.measure.phases.Phases` that gets ``wait_device``: wall seconds
    the host spent waiting for a batch to finish, and the number of such waits.
    ``on_task``: called with each task id the scheduler hands out, before MetaSchedule
    searches, builds and measures that task's batch (the tuner tells its runner which
    task's reference the batch's candidates are checked against).
    """

    def __init__(self, default_ms: list[float | None] | None = None, alpha: float = 0.2,
                 window: int = 3, max_in_flight: int = 3, seed: int = 0, phases=None,
                 tuned_ms: list[float | None] | None = None, on_task=None):
        super().__init__()
        self.on_task = on_task
        if max_in_flight < 1:
            raise ValueError(f"max_in_flight must be at least 1, got {max_in_flight}")
        self.default_ms = list(default_ms or [])
        self.tuned_ms = list(tuned_ms or [])
        self.alpha, self.window, self.max_in_flight = alpha, window, max_in_flight
        self.rng = random.Random(seed)
        self.phases = phases
        self.history: list[list[float]] | None = None
        self.order: list[int] = []      # task ids sent to the runner, oldest first, not joined
        self.first_round: list[int] = []  # tasks still owed their first batch, in task order
        #: set (by a signal handler) to end the run: no new batch is sent; MetaSchedule then
        #: joins the batches in flight and logs their results
        self.stopping = False

    # ---- bookkeeping ----------------------------------------------------------------------
    def _init(self, n: int) -> None:
        def known(values, i):
            v = values[i] if i < len(values) else None
            return v if v is not None and math.isfinite(v) and v > 0 else None

        self.history, self.first_round = [], []
        for i in range(n):
            d, t = known(self.default_ms, i), known(self.tuned_ms, i)
            h = [d] if d is not None else []
            if t is not None:
                h.append(min(t, d) if d is not None else t)
            else:
                self.first_round.append(i)
            self.history.append(h)
        self.first_round.reverse()  # popped from the end: task order

    def _join(self, task_id: int, tasks) -> None:
        """Join ``task_id``'s batch (MetaSchedule waits for any result still out, then records
        them); its best latency goes into the history. A task whose search ended (no batch was
        sent: MetaSchedule terminated it) is only dropped."""
        self.order.remove(task_id)
        if tasks[task_id].runner_futures is None:
            return
        results = self.join_running_task(task_id)
        best = math.inf
        for r in results:
            if r.error_msg is None and r.run_secs:
                best = min(best, 1e3 * sum(float(s) for s in r.run_secs) / len(r.run_secs))
        h = self.history[task_id]
        h.append(min(best, h[-1]) if h else best)

    def _join_finished(self, tasks) -> None:
        """Join every batch whose trials have all come back."""
        for task_id in finished(self.order, tasks):
            self._join(task_id, tasks)

    def _join_first(self, tasks) -> None:
        """Wait until at least one batch in flight has all its results, and join those that
        have (the time waited goes to ``wait_device``)."""
        t0 = time.perf_counter()
        while not finished(self.order, tasks) and not self.stopping:
            time.sleep(POLL_S)
        if self.phases is not None:
            self.phases.add("wait_device", time.perf_counter() - t0, wall=True)
        self._join_finished(tasks)

    def _gradient(self, task_id: int, weight: float) -> float:
        h = self.history[task_id]
        if not h or not math.isfinite(h[-1]):
            return 0.0
        best, w = h[-1], self.window
        back = (h[-1 - w] - best) / w if len(h) > w and math.isfinite(h[-1 - w]) else 0.0
        return weight * (self.alpha * back + (1 - self.alpha) * best / len(h))

    def _hand_out(self, task_id: int) -> int:
        self.order.append(task_id)
        if self.on_task is not None:
            self.on_task(task_id)
        return task_id

    # ---- MetaSchedule's hook ---------------------------------------------------------------
    def next_task_id(self) -> int:
        if self.stopping:
            return -1
        tasks = self._outer().tasks_
        n = len(tasks)
        if self.history is None:
            self._init(n)
        self._join_finished(tasks)
        while len(self.order) >= self.max_in_flight and not self.stopping:  # bound batches
            self._join_first(tasks)                                            # in flight
        if self.stopping:  # (a signal while waiting)
            return -1
        # first, one batch of every task with no record (MetaSchedule's gradient scheduler gives
        # one to every task)
        while self.first_round:
            task_id = self.first_round.pop()
            if not tasks[task_id].is_terminated:
                return self._hand_out(task_id)
        while True:
            alive = [i for i in range(n) if not tasks[i].is_terminated]
            if not alive:
                return -1
            idle = [i for i in alive if i not in self.order]
            if not idle:  # every live task has a batch out: wait for the first to finish
                self._join_first(tasks)
                if self.stopping:
                    return -1
                continue
            grads = {i: self._gradient(i, float(tasks[i].task_weight)) for i in idle}
            top = max(grads.values())
            best = [i for i, g in grads.items() if g == top]
            task_id = best[0] if len(best) == 1 else self.rng.choice(best)
            return self._hand_out(task_id)
