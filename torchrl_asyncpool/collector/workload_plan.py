"""Where the collector's processes run, decided from what it measures while it runs.

The default (``worker_affinity="auto"``, ``driver_affinity="auto"``) starts partitioned: the
policy on the first CPU, the env workers on the others (see :mod:`torchrl_asyncpool._sys.affinity`).
That wins when serving a record costs about as much as stepping it (CartPole: ~10 us a step on
either side), and loses when the envs are the work: on 2 cores, Atari through gymnasium (~1.3 ms a
step) ran 1.4x faster unpinned, MuJoCo's HalfCheetah with 64 envs 1.36x, because the partition
gives a whole core to a policy that needs a fraction of one and crowds every env onto the other.

Between the two, an env step of a few tens of microseconds (MuJoCo's HalfCheetah, ~45 us) leaves
the policy's core mostly idle, yet unpinned workers wait for their answers about as long as they
step. Where the pool has two workers a core or more, the ``"shared"`` layout keeps the policy on
its CPU and moves a share of the workers (:func:`shared_worker_masks`) onto it, so that its idle
time steps envs. Measured on 2 cores (commit ``c74a7e3``, 2026-12-05, HalfCheetah-v5 and
``compare_real.py``'s cheap policy, interleaved): 16 envs in 4 workers (``envs_per_worker=4``,
shared) 21,305-21,951 frames/s against 18,628-19,719 for 2 workers (one a CPU, partitioned), 3
rounds; 64 envs in 4 workers 28,979 / 30,344 against 27,684 / 29,212 (2 workers,
then unpinned), 2 rounds. ``envs_per_worker="auto"`` groups such envs two workers a core only
where the policy leaves its CPU room (:func:`startup_workers_per_core`, below): with 4 workers
TorchRL's PPO recipe (``sota-implementations/ppo_mujoco.py``, 16 envs, a learner in the
collector's process, a ``TanhNormal`` actor) ran at 3,334-3,876 frames/s against 3,927-4,046 with 2.

Sharing only pays while the policy's core has room: the serving thread's CPU an env step
(``s``, the policy's call and the serving loop) and the workers' (``w``) say where each layout's
bottleneck is. Partitioned, the busier of the policy's CPU (``s``) and the workers' (``w / (C -
1)`` each, ``C`` CPUs); shared, with a fraction ``f`` of the workers moved, the busier of ``s + f
w`` and ``(1 - f) w / (C - 1)``. The plan shares where that predicts at least
``1 / SHARE_GAIN`` of the partition's rate and takes the workers back where it predicts no gain.
Measured on 2 cores (2026-12-06, HalfCheetah-v5, 16 envs in 4 workers): ``compare_real.py``'s
cheap policy served for ~20 us of CPU a frame against the workers' ~54 us (shared, collecting
in bursts between pauses as PPO does: 22,239-23,104 frames/s against 19,131-20,195 for 2
workers, one a CPU); the PPO recipe's ``TanhNormal`` actor for ~70 us against ~75 us (batches of
~5 records), where 4 shared workers lost to 2 (3,823-3,966 frames/s end to end
against 3,961-4,131, the learner waiting 24 % of its time against 22 %). The serving
thread is weighed in the thread inference server only (``policy_backend="threading"``, the
default); a server process is not, and the step lines alone decide there. Before any worker
runs, :func:`startup_workers_per_core` makes the same prediction from the start-up probe's CPU a
step and the policy's cost timed on zero records (plus :data:`SERVING_BATCH_S` a batch): it
decides whether ``envs_per_worker="auto"`` groups mid-cost envs two workers a core (the shared
layout on offer) or one (the partition as the only pinned layout).

:class:`AffinityPlan` looks at the workers' env steps about every second, over the steps since
its last look, and moves between the layouts ``"partitioned"``, ``"shared"`` (only where the pool
has two workers a CPU or more) and ``"unpinned"`` (workers, serving side and the iterating thread
on every CPU). With one worker a CPU it weighs a step's wall time (the arena's ``step_time`` over
``step_count``) against :data:`UNPIN_STEP_S` and :data:`PIN_STEP_S`, and starts unpinned where the
start-up probe's step already says it would lift the partition (:data:`START_UNPINNED_PROBE_S`).
Where the pool can share, it weighs the workers' CPU a step instead (their main threads' CPU time
from ``/proc``, :class:`~torchrl_asyncpool._sys.cpu_time.CpuMeter`: the env's step and the
worker's share of the exchange), since the shared layout changes who shares a core and a step's
wall time counts the turns of whatever does; its lines are :data:`SHARE_STEP_S` /
:data:`UNSHARE_STEP_S` and :data:`SHARED_UNPIN_STEP_S` / :data:`SHARED_PIN_STEP_S`. The gap
between each pair of lines keeps a workload near a line from switching back and forth, and a
window of fresh steps (not the start-up's) keeps a moment of load from deciding for good (with the
workers' CPU, the window opens at the first look after the first batch). Explicit masks are never
touched: the plan runs only for the ``"auto"`` partition.
"""
from __future__ import annotations

import math
import time
from typing import Callable, Mapping, Optional, Sequence, Tuple

from torchrl_asyncpool.exchange.metrics import SumWindow

__all__ = ["AffinityPlan", "LAYOUTS", "UNPIN_STEP_S", "PIN_STEP_S", "START_UNPINNED_PROBE_S", "SHARE_STEP_S",
           "UNSHARE_STEP_S", "SHARED_UNPIN_STEP_S", "SHARED_PIN_STEP_S", "SHARE_GAIN", "PLAN_PERIOD_S",
           "MID_COST_PROBE_S", "SERVING_BATCH_S", "shared_split", "shared_worker_masks", "startup_workers_per_core"]

#: the CPU layouts of the default partition, from the policy's CPU kept for it alone to none kept
LAYOUTS = ("partitioned", "shared", "unpinned")
#: with one worker a CPU, a mean env step (wall time) at least this long lifts the partition ...
UNPIN_STEP_S = 80e-6
#: ... and one shorter than this restores it
PIN_STEP_S = 40e-6
#: with one worker a CPU, a start-up probe's mean step (wall time, the spec env's first steps: about
#: 1.2-2x a worker's warm step) at least this long starts the pool unpinned: the plan's first look
#: would lift the partition a second later (Atari through gymnasium probes at ~320-690 us; its
#: first second partitioned delivered 1,536 frames against 2,048-3,072 unpinned, 16 envs, 2 cores)
START_UNPINNED_PROBE_S = 2 * UNPIN_STEP_S
#: where the pool can share, the workers' CPU a step from this long moves a share of them onto
#: the policy's CPU ...
SHARE_STEP_S = 25e-6
#: ... and one shorter than this takes them off it again
UNSHARE_STEP_S = 12e-6
#: where the pool can share the policy's CPU, a step lifts the partition from this long ...
SHARED_UNPIN_STEP_S = 200e-6
#: ... and one shorter than this restores it (shared). The workers' CPU a MuJoCo step measured
#: 50-90 us on the benchmark VM as its phases change (CartPole 9-15 us, Atari ~480 us): with 4
#: workers the ``"shared"`` layout measured 1.2-1.3x the unpinned one there (16 and 64 envs), so
#: the lines sit well above it
SHARED_PIN_STEP_S = 120e-6
#: where the serving thread's CPU is measured, the shared layout's predicted bottleneck must be at
#: most this share of the partition's for the workers to move (they move back where it is no lower)
SHARE_GAIN = 0.9
#: the start-up probe's median CPU a step (``probe_step_cpu_median_s``) of the mid-cost envs a
#: collector may group two workers a core, for the shared layout; the prediction of
#: :func:`startup_workers_per_core` decides within it, from the probe's mean (the spec env's first
#: steps, cold: about 1.2-2x a worker's warm step). The band was first drawn on the mean, which
#: varies about 2x with the host (2 vCPUs of one AMD EPYC VM, 2026-12-06, in a slow and a fast
#: hour): gymnasium's CartPole-v1 ~15-17 / ~10-13 us, TorchRL's GymEnv of it ~25 / ~11-13,
#: Pendulum-v1 ~22-26 / ~15-17, HalfCheetah-v5 ~65-110 / ~35-45 and Atari through gymnasium
#: ~500-690 / ~317-333. A band of (40, 300) us sent HalfCheetah one worker a core in the fast hour
#: (0.79x the shared layout's frames/s) and nearly let Atari in. One from 20 us let CartPole in: the
#: first build in a fresh process probed 22 us (10.6-18.4 in the seven builds after it), the
#: prediction said 0.97, and 4 workers of 8 envs then collected 0.62-0.81x what 2 of 16 did (32
#: envs, 3 interleaved pairs): the prediction does not see what more, smaller processes cost so
#: cheap a step. The mean carries the fresh env's first step (200-700 us of CPU whatever the env),
#: 6-20 us over ~32 steps, enough to put Pendulum at 37 us once; the medians in fresh processes
#: (2026-12-06, 21:58-22:05 UTC): CartPole-v1 7.5-12 us, TorchRL's GymEnv of it 10-19, Pendulum-v1
#: 12-14, HalfCheetah-v5 36-58 and TorchRL's factory of it 41-44. 30 us lies between the cheap and
#: the mid-cost medians with a margin on both sides. From 200 us (the line where the plan lifts a
#: shared partition, :data:`SHARED_UNPIN_STEP_S`) the workers end up unpinned, where 4 workers of
#: Atari measured 0.98x 2
MID_COST_PROBE_S = (30e-6, 200e-6)
#: the serving loop's own CPU a batch besides the policy's call (lease, action check, answer,
#: statistics), for the start-up prediction: on 2 cores (2026-12-06, HalfCheetah-v5, 4 workers of 4
#: envs) ~150 us a batch of ~7.5 records with a policy call of ~90 us
SERVING_BATCH_S = 60e-6
#: seconds between two looks at the measured env step
PLAN_PERIOD_S = 1.0
#: the fewest fresh env steps a look trusts
_MIN_STEPS = 64


def shared_worker_masks(policy_mask: Sequence[int], worker_masks: Sequence[Sequence[int]]) -> Optional[list]:
    """The workers' masks of the ``"shared"`` layout: the last ``round(W / (2C - 1))`` of the
    ``W`` workers on the policy's CPU, the others as partitioned (``C`` CPUs in all: the policy's
    core, which serves too, takes about half a core's share of the workers); ``None`` when the
    pool has fewer than two workers a CPU (the layout is then the partition itself).

    Examples:
        >>> from torchrl_asyncpool.collector.workload_plan import shared_worker_masks
        >>> shared_worker_masks((0,), [(1,)] * 4)  # 2 CPUs, 4 workers: one moves to CPU 0
        [(1,), (1,), (1,), (0,)]
        >>> shared_worker_masks((0,), [(1,)] * 2) is None  # one worker a CPU: nothing to share
        True
    """
    workers = len(worker_masks)
    if workers < 2 * _partition_cpus(policy_mask, worker_masks):
        return None
    moved = round(shared_split(policy_mask, worker_masks)[0] * workers)
    return [tuple(m) for m in worker_masks[:workers - moved]] + [tuple(policy_mask)] * moved


def _partition_cpus(policy_mask: Sequence[int], worker_masks: Sequence[Sequence[int]]) -> int:
    return len(set(policy_mask) | {c for mask in worker_masks for c in mask})


def _moved_workers(workers: int, cpus: int) -> int:
    """How many of ``workers`` the ``"shared"`` layout moves onto the policy's CPU, with ``cpus``
    CPUs in all: ``round(W / (2C - 1))``, at least one."""
    return max(1, round(workers / (2 * cpus - 1)))


def shared_split(policy_mask: Sequence[int], worker_masks: Sequence[Sequence[int]]) -> Tuple[float, int]:
    """``(the share of the workers the "shared" layout moves onto the policy's CPU, the CPUs of
    the partition, the policy's included)``: what :class:`AffinityPlan` weighs as
    ``moved_fraction`` and ``cpus``.

    Examples:
        >>> from torchrl_asyncpool.collector.workload_plan import shared_split
        >>> shared_split((0,), [(1,)] * 4)  # 2 CPUs, 4 workers: one moves
        (0.25, 2)
        >>> shared_split((0,), [(1, 2, 3)] * 8)  # 4 CPUs, 8 workers: round(8 / 7) = 1 moves
        (0.125, 4)
    """
    workers, cpus = len(worker_masks), _partition_cpus(policy_mask, worker_masks)
    return _moved_workers(workers, cpus) / workers, cpus


def _share_ratio(step: float, serving: float, moved_fraction: float, cpus: int) -> float:
    """The shared layout's busiest CPU over the partition's, from the workers' CPU an env step
    (``step``) and the serving thread's (``serving``): below 1, sharing is predicted to collect
    faster (see the module docstring)."""
    others = cpus - 1
    partitioned = max(serving, step / others)
    shared = max(serving + moved_fraction * step, (1.0 - moved_fraction) * step / others)
    return shared / partitioned


def _cost_at(cost: Mapping[int, float], size: int) -> float:
    """The policy's cost a call at ``size`` records, interpolated linearly between the timed
    sizes (the nearest one outside them)."""
    sizes = sorted(cost)
    if size <= sizes[0]:
        return cost[sizes[0]]
    for lo, hi in zip(sizes, sizes[1:]):
        if size <= hi:
            return cost[lo] + (cost[hi] - cost[lo]) * (size - lo) / (hi - lo)
    return cost[sizes[-1]]


def startup_workers_per_core(policy_cost: Mapping[int, float]) -> Callable[[dict, int, int], int]:
    """A collector's grouping rule for :meth:`PoolPlan.build <torchrl_asyncpool.pool.plan.PoolPlan.build>`:
    ``(measured, num_envs, cores) -> workers per core``. Two workers a core (so that the plan can
    move a share of them onto the policy's CPU, the ``"shared"`` layout) where the start-up probe
    measured a mid-cost step (:data:`MID_COST_PROBE_S`, the median CPU time of a step, which a
    fresh env's costly first step does not move) and the policy, at its measured
    cost (``policy_cost``: ``{batch size: seconds}``, timed by
    :func:`~torchrl_asyncpool.collector.policy_cost.measure_policy_cost`) and
    :data:`SERVING_BATCH_S` a batch of one worker's envs, is predicted to leave its core the
    room for them (the shared layout's busiest CPU predicted less busy than the partition's, the
    balance of the module docstring, with the probe's mean CPU a step); one a core otherwise.
    What it weighed goes into ``measured`` (``predicted_serving_s``, ``predicted_share_ratio``).

    Unlike the running plan's move (:data:`SHARE_GAIN`), the rule keeps no margin: the prediction
    errs on the policy's side (it answers each worker's envs in a batch of their own, where the
    shared layout measured batches of about two workers' envs and half the predicted serving CPU a
    frame), and the two errors cost unlike amounts. On 2 cores (2026-12-06, a fast hour),
    HalfCheetah-v5 predicted 0.81-0.92 with the cheap policy, and one worker a core collected 0.79x
    what two did, where two a core had cost the PPO recipe's actor (predicted 1.11) ~4 %; with
    two a core the running plan can still keep the partition.

    Examples:
        >>> from torchrl_asyncpool.collector.workload_plan import startup_workers_per_core
        >>> cheap, costly = {1: 60e-6, 8: 75e-6}, {1: 280e-6, 8: 330e-6}  # a mean of the observation; PPO's actor
        >>> measured = {"probe_step_cpu_s": 90e-6, "probe_step_cpu_median_s": 60e-6}  # HalfCheetah-v5
        >>> startup_workers_per_core(cheap)(measured, 16, 2), round(measured["predicted_share_ratio"], 2)
        (2, 0.75)
        >>> startup_workers_per_core(costly)(measured, 16, 2), round(measured["predicted_share_ratio"], 2)
        (1, 1.25)
        >>> cartpole = {"probe_step_cpu_s": 31e-6, "probe_step_cpu_median_s": 12e-6}  # a costly first step
        >>> startup_workers_per_core(cheap)(cartpole, 16, 2)  # a cheap step: one a core
        1
    """
    cost = dict(policy_cost)

    def workers_per_core(measured: dict, num_envs: int, cores: int) -> int:
        step, median = measured.get("probe_step_cpu_s"), measured.get("probe_step_cpu_median_s")
        if not cost or cores < 2 or median is None or not MID_COST_PROBE_S[0] <= median < MID_COST_PROBE_S[1]:
            return 1
        per_worker = math.ceil(num_envs / (2 * cores))
        workers = math.ceil(num_envs / per_worker)
        if workers < 2 * cores:  # too few envs for two workers a core
            return 1
        serving = (_cost_at(cost, per_worker) + SERVING_BATCH_S) / per_worker  # a worker's envs answered together
        ratio = _share_ratio(step, serving, _moved_workers(workers, cores) / workers, cores)
        measured["predicted_serving_s"], measured["predicted_share_ratio"] = serving, ratio
        return 2 if ratio < 1.0 else 1

    return workers_per_core


class AffinityPlan:
    """Keeps, shares or lifts the collector's default CPU partition as the measured env step says.

    Args:
        measure (callable): ``() -> (total env step seconds, env steps)``, sums since the start.
        apply (callable): ``(layout: str) -> None``, moves the processes and threads to one of
            :data:`LAYOUTS`.
        layout (str): the layout in force now, one of :data:`LAYOUTS`.
        can_share (bool): whether the ``"shared"`` layout differs from the partition (two
            workers a CPU or more, see :func:`shared_worker_masks`); when not, the plan moves
            between ``"partitioned"`` and ``"unpinned"`` only.
        first_look_opens (bool): whether the first look only opens the first window (half a
            period long), for a ``measure`` that also counts what happens before the first steps
            (the workers' CPU counts their envs' construction); otherwise the window opens here
            and the first look comes a period later.
        serving (callable, optional): ``() -> seconds``, the serving thread's CPU since the
            start, weighed per env step against the workers' (``measure``) before sharing (see
            the module docstring); ``None``: the step lines alone decide.
        moved_fraction (float): the share of the workers the ``"shared"`` layout moves onto the
            policy's CPU (see :func:`shared_split`).
        cpus (int): the CPUs of the partition, the policy's included (see :func:`shared_split`).

    Examples:
        >>> from torchrl_asyncpool.collector.workload_plan import AffinityPlan
        >>> sums, moves = [0.0, 0], []
        >>> plan = AffinityPlan(lambda: tuple(sums), moves.append, layout="partitioned", can_share=True,
        ...                     first_look_opens=True)
        >>> plan.update(now=plan.next_look)  # the first look opens the window
        >>> sums[:] = [1000 * 45e-6, 1000]  # MuJoCo-like steps: 45 us each
        >>> plan.update(now=plan.next_look)
        >>> moves, plan.layout, round(plan.measured_step_s, 6)
        (['shared'], 'shared', 4.5e-05)
        >>> sums[0] += 1000 * 1.3e-3; sums[1] += 1000  # Atari-like steps: 1.3 ms each
        >>> plan.update(now=plan.next_look)
        >>> moves, plan.partitioned
        (['shared', 'unpinned'], False)

        With the serving thread's CPU weighed too, a policy that keeps its core busy keeps it:

        >>> sums, served, moves = [0.0, 0], [0.0], []
        >>> plan = AffinityPlan(lambda: tuple(sums), moves.append, can_share=True, first_look_opens=True,
        ...                     serving=lambda: served[0], moved_fraction=0.25, cpus=2)
        >>> plan.update(now=plan.next_look)
        >>> sums[:] = [1000 * 60e-6, 1000]; served[0] = 1000 * 55e-6  # 60 us a step, 55 us of serving
        >>> plan.update(now=plan.next_look)
        >>> moves, plan.layout
        ([], 'partitioned')
        >>> sums[0] += 1000 * 60e-6; sums[1] += 1000; served[0] += 1000 * 20e-6  # a cheap policy
        >>> plan.update(now=plan.next_look)
        >>> moves, plan.layout
        (['shared'], 'shared')
    """

    def __init__(self, measure: Callable[[], Tuple[float, int]], apply: Callable[[str], None],
                 layout: str = "partitioned", can_share: bool = False, first_look_opens: bool = False,
                 serving: Optional[Callable[[], float]] = None, moved_fraction: float = 0.25, cpus: int = 2):
        if layout not in LAYOUTS or (layout == "shared" and not can_share):
            raise ValueError(f"layout must be one of {LAYOUTS} ('shared' only with can_share=True), got {layout!r}.")
        if not 0.0 < moved_fraction < 1.0 or int(cpus) < 2:
            raise ValueError(f"moved_fraction must lie in (0, 1) and cpus be at least 2, got {moved_fraction!r} "
                             f"and {cpus!r}.")
        self._measure, self._apply, self._serving = measure, apply, serving
        self.layout = layout
        self.can_share = bool(can_share)
        self.moved_fraction, self.cpus = float(moved_fraction), int(cpus)
        self.measured_step_s: Optional[float] = None
        self.measured_serving_s: Optional[float] = None
        self.changes = 0
        # the workers' CPU until the first look counts their envs' construction (an import of a
        # simulator weighs more than thousands of its steps): that window is not taken
        self._window: Optional[SumWindow] = None
        self._serving_window: Optional[SumWindow] = None
        if not first_look_opens:
            self._open()
        self.next_look = time.monotonic() + (0.0 if first_look_opens else PLAN_PERIOD_S)

    def _sums(self) -> tuple:
        steps = self._measure()
        return steps, (None if self._serving is None else (self._serving(), steps[1]))

    def _open(self) -> None:
        steps, served = self._sums()
        self._window = SumWindow(steps, _MIN_STEPS)
        self._serving_window = None if served is None else SumWindow(served, _MIN_STEPS)

    @property
    def partitioned(self) -> bool:
        """Whether the policy keeps its CPU (``"partitioned"`` or ``"shared"``)."""
        return self.layout != "unpinned"

    def _sharing_pays(self, step: float, serving: Optional[float]) -> bool:
        """Whether the shared layout's busiest CPU is predicted less busy than the partition's
        (by :data:`SHARE_GAIN` to move there, at all to stay), from the workers' and the serving
        thread's CPU an env step; ``True`` when the serving thread is not measured."""
        if serving is None:
            return True
        ratio = _share_ratio(step, serving, self.moved_fraction, self.cpus)
        return ratio < 1.0 if self.layout == "shared" else ratio <= SHARE_GAIN

    def _wanted(self, step: float, serving: Optional[float] = None) -> str:
        layout = self.layout
        unpin, pin = (SHARED_UNPIN_STEP_S, SHARED_PIN_STEP_S) if self.can_share else (UNPIN_STEP_S, PIN_STEP_S)
        if step >= unpin:
            return "unpinned"
        if layout == "unpinned" and step >= pin:
            return layout
        if not (self.can_share and self._sharing_pays(step, serving)):
            return "partitioned"
        if layout == "shared" and step >= UNSHARE_STEP_S:
            return layout
        return "shared" if step >= SHARE_STEP_S else "partitioned"

    def update(self, now: Optional[float] = None) -> None:
        """Looks at the env steps since the last look, when one is due; moves the processes
        when the mean step crossed a line (see ``first_look_opens``)."""
        now = time.monotonic() if now is None else now
        if now < self.next_look:
            return
        if self._window is None:
            self._open()
            self.next_look = now + PLAN_PERIOD_S / 2
            return
        self.next_look = now + PLAN_PERIOD_S
        steps, served = self._sums()
        taken = self._window.take(steps)
        if taken is None:
            return
        self.measured_step_s = step = taken[0]
        served = None if self._serving_window is None else self._serving_window.take(served)
        if served is not None:  # the same steps count both windows: taken together
            self.measured_serving_s = served[0]
        want = self._wanted(step, self.measured_serving_s)
        if want != self.layout:
            self._apply(want)
            self.layout = want
            self.changes += 1

    def describe(self) -> dict:
        """What the plan measured and chose (for ``repr`` and the collector's metrics)."""
        return {"partitioned": self.partitioned, "cpu_layout": self.layout, "measured_env_step_s": self.measured_step_s,
                "measured_serving_s": self.measured_serving_s, "partition_changes": self.changes}
