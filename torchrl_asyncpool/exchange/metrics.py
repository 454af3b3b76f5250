"""Always-on pool health metrics, cheap enough for the hot path (a few float adds per call).

The consumer (wherever it runs: the pool's process or an inference-server process) adds its
sums into the arena's ``consumer_stats`` vector; workers add their step timers into their
slots. Readers never write shared memory: :class:`PoolMetrics` keeps its own baseline, so
``metrics(reset=True)`` in one process cannot race the consumer in another.
"""
from __future__ import annotations

import time

import numpy as np

__all__ = ["PoolMetrics", "METRIC_KEYS", "STAT_SLOTS", "record_recv", "record_send", "record_wait", "log_metrics",
           "SumWindow"]

#: Keys of :meth:`AsyncEnvPool.metrics <torchrl_asyncpool.AsyncEnvPool.metrics>` and what they mean.
METRIC_KEYS = {
    "frames": "records handed out by recv since the last reset",
    "batches": "recv calls that returned a batch",
    "fps": "frames per second of wall time since the last reset",
    "elapsed_s": "wall time since the last reset",
    "batch_fill_ratio": "mean of batch size / max_get (max_get=None counts as num_envs)",
    "partial_batch_fraction": "fraction of batches smaller than max_get",
    "mean_batch_size": "mean records per batch",
    "obs_to_batch_dwell_s": "mean time a record waited ready before recv leased it",
    "batch_to_action_dwell_s": "mean time from recv leasing a slot to send answering it",
    "consumer_busy_fraction": "share of wall time the consumer spent outside recv's waits",
    "env_step_time_s": "mean seconds per env step or reset, measured in the workers",
    "env_steps": "env steps and resets done by the workers since the last reset",
    # not windowed
    "env_restarts": "envs rebuilt after a failure over the pool's life (only with on_env_failure='restart')",
    "worker_restarts": "worker processes replaced after they died or hung (only with on_env_failure='restart')",
    "slots_<path>": "slots whose env steps on <path> (slots_gymnasium, slots_torchrl_fast, slots_torchrl, ...)",
    "num_workers": "env workers (processes, or threads with backend='threading')",
    "envs_per_worker": "slots per worker, as given or as envs_per_worker='auto' chose it from the spec env's step",
    "env_threads": "1 when each env of a worker steps in its own thread (env_threads, or 'auto' for envs that block)",
    "idle_poll": "1 when the workers' and the serving loop's waits idle-poll (idle_poll, or 'auto': the wake probe)",
    # the start-up plan's numbers (AsyncEnvPool.plan)
    "plan_probe_step_s": "mean wall time of a spec env step timed at start-up (nan when it was not timed)",
    "plan_blocking": "1 when that timing found the env blocks (waits more than it computes), 0 if not, nan untimed",
    "plan_record_bytes": "bytes of one slot's record and answer (the fields one step moves)",
    "plan_pinned_workers": "worker processes given a CPU mask at start-up (0: none pinned)",
}

# Positions in the arena's consumer_stats vector.
_FRAMES, _BATCHES, _PARTIAL, _FILL, _OBS_DWELL, _ACT_DWELL, _ACTIONS, _WAIT = range(8)
#: the positions, in the order the C engine (``exchange.native``) takes them
STAT_SLOTS = (_FRAMES, _BATCHES, _PARTIAL, _FILL, _OBS_DWELL, _ACT_DWELL, _ACTIONS, _WAIT)


def record_recv(stats: np.ndarray, batch: int, cap: int, obs_dwell_sum: float, waited_s: float) -> None:
    """Adds one ``recv`` to the consumer's sums (consumer only)."""
    stats[_FRAMES] += batch
    stats[_BATCHES] += 1
    stats[_PARTIAL] += batch < cap
    stats[_FILL] += batch / cap
    stats[_OBS_DWELL] += obs_dwell_sum
    stats[_WAIT] += waited_s


def record_wait(stats: np.ndarray, waited_s: float) -> None:
    """Adds time the consumer spent waiting for records outside ``recv`` (consumer only)."""
    stats[_WAIT] += waited_s


def record_send(stats: np.ndarray, count: int, action_dwell_sum: float) -> None:
    """Adds one ``send`` to the consumer's sums (consumer only)."""
    stats[_ACTIONS] += count
    stats[_ACT_DWELL] += action_dwell_sum


class PoolMetrics:
    """Reads the arena's sums as deltas over a window that :meth:`reset` restarts."""

    def __init__(self, arena):
        self._arena = arena
        self.reset()

    def reset(self) -> None:
        """Starts a new measurement window: :meth:`as_dict` counts from now."""
        a = self._arena
        self.t0 = time.monotonic()
        self._base = a.consumer_stats.copy()
        self._step_time0 = float(a.step_time.sum())
        self._step_count0 = int(a.step_count.sum())

    def as_dict(self) -> dict:
        """The metrics of the window since the last :meth:`reset`, as a flat dict of numbers (counts as ints)."""
        a = self._arena
        elapsed = max(time.monotonic() - self.t0, 1e-9)
        d = a.consumer_stats - self._base
        frames, batches, actions = int(d[_FRAMES]), int(d[_BATCHES]), int(d[_ACTIONS])
        steps = int(a.step_count.sum()) - self._step_count0
        b = max(batches, 1)
        return {
            "frames": frames,
            "batches": batches,
            "fps": frames / elapsed,
            "elapsed_s": elapsed,
            "batch_fill_ratio": float(d[_FILL]) / b,
            "partial_batch_fraction": float(d[_PARTIAL]) / b,
            "mean_batch_size": frames / b,
            "obs_to_batch_dwell_s": float(d[_OBS_DWELL]) / max(frames, 1),
            "batch_to_action_dwell_s": float(d[_ACT_DWELL]) / max(actions, 1),
            "consumer_busy_fraction": float(np.clip(1.0 - d[_WAIT] / elapsed, 0.0, 1.0)),
            "env_step_time_s": (float(a.step_time.sum()) - self._step_time0) / max(steps, 1),
            "env_steps": steps,
        }


def _scalars(metrics, prefix: str, out: dict) -> dict:
    for key, value in metrics.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):  # e.g. server_stats()["per_key"]
            _scalars(value, name + "/", out)
        elif isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool):
            out[name] = float(value) if isinstance(value, (float, np.floating)) else int(value)
    return out


def log_metrics(logger, metrics: dict, step: int | None = None, prefix: str = "") -> dict:
    """Logs the numbers of a metrics dict to a TorchRL logger, one scalar each.

    Nested dicts become ``outer/inner`` names; entries that are not numbers (a server's
    ``"mode"``) are left out.

    Args:
        logger: a TorchRL :class:`~torchrl.record.loggers.Logger` (CSV, TensorBoard, W&B, ...),
            or anything with ``log_scalar(name, value, step=None)``.
        metrics (dict): e.g. :meth:`AsyncEnvPool.metrics() <torchrl_asyncpool.AsyncEnvPool.metrics>`.
        step (int, optional): the step to log at (e.g. frames collected so far).
        prefix (str, optional): prepended to every name, e.g. ``"pool/"``.

    Returns:
        The ``{name: number}`` dict that was logged.

    Examples:
        >>> from torchrl_asyncpool.exchange.metrics import log_metrics
        >>> class Printer:
        ...     def log_scalar(self, name, value, step=None):
        ...         print(name, value, step)
        >>> logged = log_metrics(Printer(), {"fps": 10.0, "per_key": {"policy": {"frames": 3}}, "mode": "thread"},
        ...                      step=7, prefix="pool/")
        pool/fps 10.0 7
        pool/per_key/policy/frames 3 7
    """
    if not callable(getattr(logger, "log_scalar", None)):
        raise TypeError(
            "logger must be a TorchRL Logger (or have log_scalar(name, value, step=None)), "
            f"got {type(logger).__name__}."
        )
    if not isinstance(prefix, str):
        raise TypeError(f"prefix must be a str, got {type(prefix).__name__}.")
    scalars = _scalars(metrics, prefix, {})
    for name, value in scalars.items():
        logger.log_scalar(name, value, step=step)
    return scalars


class SumWindow:
    """The mean of a running ``(seconds, count)`` sum over the window since the last take: what
    the plans that watch a workload while it runs read (the env step from the arena's
    ``step_time``/``step_count`` sums, the policy's cost per record from the server's).

    Args:
        sums (tuple): ``(seconds, count)`` at the window's start.
        min_count (int): the fewest counts a window must hold to be taken (fewer: it stays open).

    Examples:
        >>> from torchrl_asyncpool.exchange.metrics import SumWindow
        >>> w = SumWindow((0.0, 0), min_count=10)
        >>> w.take((0.01, 5)) is None  # too few: the window stays open
        True
        >>> w.take((0.04, 20))  # (mean seconds, count) over the 20 since the start
        (0.002, 20)
    """

    def __init__(self, sums: tuple, min_count: int):
        self.sums = (float(sums[0]), int(sums[1]))
        self.min_count = int(min_count)

    def take(self, sums: tuple):
        """``(mean, count)`` over the window that ends at ``sums``, which starts the next one; or
        ``None`` while the window holds fewer than ``min_count`` counts."""
        seconds, count = float(sums[0]), int(sums[1])
        n = count - self.sums[1]
        if n < self.min_count:
            return None
        mean = (seconds - self.sums[0]) / n
        self.sums = (seconds, count)
        return mean, n
