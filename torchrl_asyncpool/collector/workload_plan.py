"""Where the collector's processes run, decided from what it measures while it runs.

The default (``worker_affinity="auto"``, ``driver_affinity="auto"``) starts partitioned: the
policy on the first CPU, the env workers on the others (see :mod:`torchrl_asyncpool._sys.affinity`).
That wins when serving a record costs about as much as stepping it (CartPole: ~10 us a step on
either side), and loses when the envs are the work: on 2 cores, Atari through gymnasium (~1.3 ms a
step) ran 1.4x faster unpinned, MuJoCo's HalfCheetah with 64 envs 1.36x, because the partition
gives a whole core to a policy that needs a fraction of one and crowds every env onto the other.

:class:`AffinityPlan` looks at the env step the workers measure (the arena's ``step_time`` and
``step_count`` sums) about every second, over the steps since its last look: past
:data:`UNPIN_STEP_S` it lifts the partition (workers, serving side and the iterating thread on
every CPU), below :data:`PIN_STEP_S` it restores it. The gap between the two keeps a workload near
the line from switching back and forth, and a window of fresh steps (not the start-up's) keeps a
moment of load from deciding for good. Explicit masks are never touched: the plan runs only for
the ``"auto"`` partition.
"""
from __future__ import annotations

import time
from typing import Callable, Optional, Tuple

from torchrl_asyncpool.exchange.metrics import SumWindow

__all__ = ["AffinityPlan", "UNPIN_STEP_S", "PIN_STEP_S", "PLAN_PERIOD_S"]

#: a mean env step at least this long lifts the partition ...
UNPIN_STEP_S = 80e-6
#: ... and one shorter than this restores it
PIN_STEP_S = 40e-6
#: seconds between two looks at the measured env step
PLAN_PERIOD_S = 1.0
#: the fewest fresh env steps a look trusts
_MIN_STEPS = 64


class AffinityPlan:
    """Keeps or lifts the collector's default CPU partition as the measured env step says.

    Args:
        measure (callable): ``() -> (total env step seconds, env steps)``, sums since the start.
        apply (callable): ``(partitioned: bool) -> None``, moves the processes and threads.
        partitioned (bool): whether the partition is in force now.

    Examples:
        >>> from torchrl_asyncpool.collector.workload_plan import AffinityPlan
        >>> sums, moves = [0.0, 0], []
        >>> plan = AffinityPlan(lambda: tuple(sums), moves.append, partitioned=True)
        >>> sums[:] = [1000 * 1.3e-3, 1000]  # Atari-like steps: 1.3 ms each
        >>> plan.update(now=plan.next_look)
        >>> moves, plan.partitioned, round(plan.measured_step_s, 4)
        ([False], False, 0.0013)
    """

    def __init__(self, measure: Callable[[], Tuple[float, int]], apply: Callable[[bool], None], partitioned: bool):
        self._measure, self._apply = measure, apply
        self.partitioned = bool(partitioned)
        self.measured_step_s: Optional[float] = None
        self.changes = 0
        self._window = SumWindow(measure(), _MIN_STEPS)
        self.next_look = time.monotonic() + PLAN_PERIOD_S

    def update(self, now: Optional[float] = None) -> None:
        """Looks at the env steps since the last look, when one is due; moves the processes
        when the mean step crossed a line."""
        now = time.monotonic() if now is None else now
        if now < self.next_look:
            return
        self.next_look = now + PLAN_PERIOD_S
        taken = self._window.take(self._measure())
        if taken is None:
            return
        self.measured_step_s = step = taken[0]
        want = self.partitioned
        if self.partitioned and step >= UNPIN_STEP_S:
            want = False
        elif not self.partitioned and step < PIN_STEP_S:
            want = True
        if want != self.partitioned:
            self._apply(want)
            self.partitioned = want
            self.changes += 1

    def describe(self) -> dict:
        """What the plan measured and chose (for ``repr`` and the collector's metrics)."""
        return {"partitioned": self.partitioned, "measured_env_step_s": self.measured_step_s,
                "partition_changes": self.changes}
