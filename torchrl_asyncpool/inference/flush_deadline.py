"""The serving loop's flush deadline with ``timeout="auto"``: chosen by trying both.

Waiting for more records before running a batch pays only when the machine's CPUs are the
bottleneck: a batch costs the serving loop about the same whatever its size, and the time a
bigger batch saves goes to the env workers. When they are not (envs that sleep, wait for I/O or
a simulator on other cores), the wait only adds latency to every record in it. Which case holds
depends on the envs, the policy, the cores and what else runs on them, so no rule of the env
step alone decides it: with a 2 ms sleeping env, 64 envs on 2 cores gained from a deadline and
16 envs lost 14 % with it; Atari through gymnasium (1.3 ms of CPU a step) gains from one.

So :class:`FlushDeadline` measures. The candidate deadline comes from the env step the workers
measure (:func:`~torchrl_asyncpool.inference.auto_flush_timeout`: ``0`` for cheap envs, which
ends the question). Otherwise it runs *trials*: the loop serves with the candidate and greedy
in turn, in the order wait, greedy, greedy, wait (:data:`TRIAL_ORDER`), for :data:`TRIAL_WINDOWS`
windows of :data:`TRIAL_WINDOW_S` seconds each, counts the env steps done in each (the
throughput the envs reached, whatever paces it), keeps the faster option (greedy unless waiting
wins by :data:`WAIT_MARGIN`), and holds it for :data:`HOLD_S` seconds before trying again: a
measurement taken under a moment's load does not decide for good. The order matters because
the throughput drifts while a pool warms up (episodes start, caches fill, the core partition
settles): with Atari through gymnasium it rose ~40 % over the first four windows, and an
alternating order (wait, greedy, wait, greedy) then gives every later, faster window to greedy,
which won rounds that waiting wins once warm. Wait-greedy-greedy-wait gives both options the
same mean position, so a steady drift cancels out. The first round also starts only after
:data:`SETTLE_WINDOWS` windows (1.5 s, served greedily): the steepest part of that drift is the
first second, with the serving thread and the env workers on separate cores until the
collector's core partition is looked at (and lifted for a costly step).

A round whose options differed by less than each option's own spread between its windows (a
window of a noisy minute, or the slow start of 64 envs: one round on Atari measured waiting at 539
and 1,219 frames/s) is tried again after :data:`UNSURE_HOLD_S`, up to :data:`UNSURE_RETRIES`
times in a row, instead of held for :data:`HOLD_S`.

A mean env step that moves by more than 2x since the decision starts new trials at once (an env
whose steps got slower changes what a fuller batch saves), and so does a policy whose cost moved
by more than 2x both per record and per call (a policy swapped for a bigger or smaller one). One
of the two alone is no drift: the batches' size moves it. A cheap policy costs about the same per
call whatever the batch, so its cost per record halves when its batches double, which the
decision to wait itself does while a pool warms up (measured on Atari with 16 envs: 30.7 -> 13.3
us a record); a costly one costs the same per record, so its cost per call doubles.
"""
from __future__ import annotations

import logging
import math
from typing import Dict, List, Optional

from torchrl_asyncpool.exchange.metrics import SumWindow
from torchrl_asyncpool.inference._common import auto_flush_timeout

__all__ = ["FlushDeadline", "TRIAL_WINDOW_S", "TRIAL_WINDOWS", "TRIAL_ORDER", "SETTLE_WINDOWS", "HOLD_S",
           "UNSURE_HOLD_S", "UNSURE_RETRIES", "WAIT_MARGIN"]

#: seconds each trial window serves with one option
TRIAL_WINDOW_S = 0.5
#: the options of a round's windows, in order: each gets the same mean position in the round
TRIAL_ORDER = ("wait", "greedy", "greedy", "wait")
#: windows per trial round (the length of :data:`TRIAL_ORDER`)
TRIAL_WINDOWS = len(TRIAL_ORDER)
#: windows measured before the first round starts: the collector's core partition is first
#: looked at one second after start-up (``workload_plan.PLAN_PERIOD_S``) and, for a costly step,
#: lifted then; a window later the pool runs in the layout it keeps
SETTLE_WINDOWS = 3
#: seconds a decision holds before the next trial round
HOLD_S = 15.0
#: seconds an unsure decision holds (the options differed less than each one's own spread
#: between its windows) before the next round, for at most :data:`UNSURE_RETRIES` rounds in a row
UNSURE_HOLD_S = 1.0
#: unsure rounds in a row that are retried after :data:`UNSURE_HOLD_S`; the next one holds
#: :data:`HOLD_S` (on a machine too noisy to tell, trying all the time buys nothing)
UNSURE_RETRIES = 2
#: waiting must beat greedy by this fraction of greedy's rate (ties go to greedy: less latency)
WAIT_MARGIN = 0.02
_log = logging.getLogger(__name__)

#: the fewest env steps a window must see to count (fewer: the window is measured again)
_MIN_STEPS = 32
#: a mean env step this many times larger or smaller than at the decision starts a new round
_DRIFT = 2.0


class FlushDeadline:
    """Chooses the flush deadline of a serving loop from the env steps its workers count.

    Args:
        envs_in_turn (float): envs a worker steps one after the other (see
            :func:`~torchrl_asyncpool.inference.auto_flush_timeout`).
        now (float): the clock at creation (``time.monotonic()``).
        sums (tuple): ``(total env step seconds, env steps)`` at creation.
        policy_sums (tuple, optional): ``(total policy seconds, records served, policy calls)``
            at creation; given here, :meth:`look` takes them too and a drift of the policy's cost
            per record and per call starts a round like a drift of the env step (without the
            calls, the cost per record alone).

    Attributes:
        timeout (float): the deadline in force (seconds; ``0``: greedy).
        measured_step_s (float or None): the mean env step of the last window.
        measured_policy_s (float or None): the policy's seconds per record served in the last
            window (``None``: not measured).
        measured_policy_call_s (float or None): the policy's seconds per call in the last window
            (``None``: not measured, or no calls counted).
        choice (str): ``"greedy"`` (cheap envs, or greedy won), ``"wait"`` (the deadline won),
            ``"trial"`` (a round is running), ``"settling"`` (served greedily for the first
            :data:`SETTLE_WINDOWS` windows of a costly step, before the first round) or
            ``"unmeasured"`` (no window yet).

    Examples:
        >>> from torchrl_asyncpool.inference.flush_deadline import FlushDeadline
        >>> d = FlushDeadline(envs_in_turn=1, now=0.0, sums=(0.0, 0))
        >>> d.look(1.0, (1000 * 10e-6, 1000))  # CartPole-like steps: greedy, no trials
        >>> d.choice, d.timeout
        ('greedy', 0.0)
        >>> d = FlushDeadline(envs_in_turn=1, now=0.0, sums=(0.0, 0))
        >>> for t in (0.5, 1.0, 1.5):  # 2 ms steps: three windows to settle, served greedily
        ...     d.look(t, (t * 500 * 2e-3, int(t * 500)))
        >>> d.choice, d.timeout
        ('settling', 0.0)
        >>> d.look(2.0, (1000 * 2e-3, 1000))  # then a round of trials starts, waiting first
        >>> d.choice, d.timeout
        ('trial', 0.00075)
        >>> t, steps = 2.0, 1000
        >>> for rate in (1000, 1200, 1200, 1000):  # frames/s waiting, greedy, greedy, waiting
        ...     t, steps = t + 0.5, steps + rate // 2
        ...     d.look(t, (steps * 2e-3, steps))
        >>> d.choice, d.timeout  # greedy was 20 % faster
        ('greedy', 0.0)
    """

    #: the keys of :meth:`describe`
    REPORTED = ("flush_choice", "flush_candidate_s", "flush_trial_rounds", "flush_trial_rates", "flush_trial_sure",
                "flush_trial_reason")

    def __init__(self, envs_in_turn: float, now: float, sums: tuple, policy_sums: Optional[tuple] = None):
        self.envs_in_turn = float(envs_in_turn)
        self.timeout = 0.0
        self.measured_step_s: Optional[float] = None
        self.measured_policy_s: Optional[float] = None
        self.measured_policy_call_s: Optional[float] = None
        # the policy's seconds over the records served and over its calls (taken together: the
        # calls' window is taken whenever the records' window is)
        self._policy_window = None if policy_sums is None else SumWindow(policy_sums[:2], _MIN_STEPS)
        self._call_window = (SumWindow((policy_sums[0], policy_sums[2]), 1)
                             if policy_sums is not None and len(policy_sums) > 2 else None)
        # the policy's (cost per record, cost per call) at the last decision
        self._decided_policy: Optional[tuple] = None
        self.choice = "unmeasured"
        self.candidate_s = 0.0
        self.rounds = 0
        #: the last round's rates (env steps per second) per option, one per window
        self.last_trial: Dict[str, List[float]] = {}
        #: why the running (or last) round started (``None``: no round yet)
        self.trial_reason: Optional[str] = None
        self._at, self._window = now, SumWindow(sums, _MIN_STEPS)
        self._trial: List[tuple] = []  # (option, rate) of the running round
        self._decided_step: Optional[float] = None  # the mean step when a round last decided
        self._hold_until: Optional[float] = None  # None: no round's decision is in force
        self._settled = 0  # windows measured outside rounds
        self._unsure = 0  # unsure rounds in a row

    def due(self, now: float) -> bool:
        """Whether the current window is over (the loop then calls :meth:`look`)."""
        return now - self._at >= TRIAL_WINDOW_S

    def look(self, now: float, sums: tuple, policy_sums: Optional[tuple] = None) -> None:
        """Closes the window that ends ``now`` (``sums``: the arena's step sums so far;
        ``policy_sums``: the server's policy seconds and records so far, when it was created with
        them) and sets :attr:`timeout` for the next one."""
        taken = self._window.take(sums)
        if taken is None:
            return  # too few steps to judge: the window stays open
        elapsed = max(now - self._at, 1e-9)
        self._at = now
        step, steps = taken
        self.measured_step_s = step
        self._look_policy(policy_sums)
        candidate = auto_flush_timeout(step, self.envs_in_turn)
        if candidate <= 0.0:  # cheap envs: greedy, nothing to try (a running round ends)
            self.choice, self.candidate_s, self.timeout, self._hold_until = "greedy", 0.0, 0.0, None
            return
        if self.choice == "trial":
            self._trial.append(("wait" if self.timeout > 0.0 else "greedy", steps / elapsed))
            if len(self._trial) >= TRIAL_WINDOWS:
                self._decide(now)
            else:  # the next window's option (wait, greedy, greedy, wait)
                self.timeout = self.candidate_s if TRIAL_ORDER[len(self._trial)] == "wait" else 0.0
            return
        self._settled += 1
        if self._settled <= SETTLE_WINDOWS and self.rounds == 0:
            self.choice = "settling"  # served greedily until the pool's start-up drift has passed
            return
        if self._decided_policy is None and self._hold_until is not None and self.measured_policy_s is not None:
            self._decided_policy = (self.measured_policy_s, self.measured_policy_call_s)
        step_drift = _drifted(step, self._decided_step)
        policy_drift = self._policy_drifted()
        if self._hold_until is None or now >= self._hold_until or step_drift or policy_drift:
            self.trial_reason = why = (
                "the first round" if self._hold_until is None else
                f"the env step moved from {self._decided_step * 1e6:.0f} to {step * 1e6:.0f} us" if step_drift
                else f"the policy's cost per record moved from {self._decided_policy[0] * 1e6:.1f} to "
                     f"{self.measured_policy_s * 1e6:.1f} us" if policy_drift else "the hold ended")
            _log.debug("flush deadline: a trial round of %.2f ms against greedy starts (%s)", candidate * 1e3, why)
            self.candidate_s, self.choice, self._trial = candidate, "trial", []
            self.timeout = candidate

    def _decide(self, now: float) -> None:
        rates: Dict[str, List[float]] = {"wait": [], "greedy": []}
        for option, rate in self._trial:
            rates[option].append(rate)
        self.last_trial, self.rounds = rates, self.rounds + 1
        wait, greedy = _mean(rates["wait"]), _mean(rates["greedy"])
        self.choice = "wait" if wait > greedy * (1.0 + WAIT_MARGIN) else "greedy"
        self.timeout = self.candidate_s if self.choice == "wait" else 0.0
        # a round the noise decided is tried again soon, a few times, instead of held for HOLD_S
        sure = _sure(rates)
        self._unsure = 0 if sure is not False else self._unsure + 1
        hold = UNSURE_HOLD_S if 0 < self._unsure <= UNSURE_RETRIES else HOLD_S
        _log.debug("flush deadline: round %d, env steps/s waiting %s, greedy %s: %s (%s), held %.0f s", self.rounds,
                   [round(r) for r in rates["wait"]], [round(r) for r in rates["greedy"]], self.choice,
                   "sure" if sure else "within the windows' own spread", hold)
        self._decided_step, self._hold_until = self.measured_step_s, now + hold
        # the policy's cost per record depends on the batch sizes the option gives: its reference
        # is the first window served under the decision
        self._decided_policy = None

    def _look_policy(self, policy_sums: Optional[tuple]) -> None:
        """The policy's cost per record and per call over the window (kept from the last window
        that served enough records)."""
        if policy_sums is None or self._policy_window is None:
            return
        taken = self._policy_window.take(policy_sums[:2])
        if taken is None:
            return  # the window stays open
        self.measured_policy_s = taken[0]
        if self._call_window is not None:
            calls = self._call_window.take((policy_sums[0], policy_sums[2]))
            self.measured_policy_call_s = None if calls is None else calls[0]

    def _policy_drifted(self) -> bool:
        """Whether the policy's cost moved by more than :data:`_DRIFT` times since the decision,
        per record and (where calls are counted) per call alike, in the same direction."""
        if self._decided_policy is None:
            return False
        record_ref, call_ref = self._decided_policy
        if not _drifted(self.measured_policy_s, record_ref):
            return False
        call = self.measured_policy_call_s
        if call is None or not call_ref:
            return True
        return _drifted(call, call_ref) and (call > call_ref) == (self.measured_policy_s > record_ref)

    def describe(self) -> dict:
        """The decision and the measurements behind it (for the collector's ``plan()``)."""
        return {
            "flush_choice": self.choice,
            "flush_candidate_s": self.candidate_s,
            "flush_trial_rounds": self.rounds,
            "flush_trial_rates": {k: [round(r, 1) for r in v] for k, v in self.last_trial.items()},
            "flush_trial_sure": _sure(self.last_trial),
            "flush_trial_reason": self.trial_reason,
        }


def _sure(rates: Dict[str, List[float]]) -> Optional[bool]:
    """Whether a round's options differ by more than each option's own window-to-window spread
    (``None``: no round)."""
    if not rates.get("wait") or not rates.get("greedy"):
        return None
    spread = {k: (max(v) - min(v)) / max(_mean(v), 1e-9) for k, v in rates.items() if len(v) > 1}
    gap = abs(_mean(rates["wait"]) / max(_mean(rates["greedy"]), 1e-9) - 1.0)
    return bool(gap > max(spread.values(), default=math.inf))


def _mean(values) -> float:
    """The mean of ``values`` (0 for none)."""
    return sum(values) / len(values) if values else 0.0


def _drifted(now_value: Optional[float], at_decision: Optional[float]) -> bool:
    """Whether a measured cost moved by more than :data:`_DRIFT` times since the decision."""
    if now_value is None or not at_decision or at_decision <= 0.0:
        return False
    return not (1.0 / _DRIFT <= now_value / at_decision <= _DRIFT)
