"""Always-on pool health metrics, cheap enough for the hot path (a few float adds per call)."""
from __future__ import annotations

import time

import numpy as np

__all__ = ["PoolMetrics", "METRIC_KEYS"]

#: Keys of :meth:`AsyncEnvPool.metrics` and what they mean.
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
}


class PoolMetrics:
    """Consumer-side accumulators plus the worker-written step timers of the arena."""

    def __init__(self, arena, num_slots: int):
        self._arena = arena
        self._num_slots = num_slots
        self.reset()

    def reset(self) -> None:
        self.t0 = time.monotonic()
        self.frames = 0
        self.batches = 0
        self.partial = 0
        self.fill_sum = 0.0
        self.obs_dwell_sum = 0.0
        self.action_dwell_sum = 0.0
        self.actions = 0
        self.wait_s = 0.0
        self._step_time0 = float(self._arena.step_time.sum())
        self._step_count0 = int(self._arena.step_count.sum())

    def on_recv(self, batch: int, cap: int, obs_dwell_sum: float, waited_s: float) -> None:
        self.frames += batch
        self.batches += 1
        self.fill_sum += batch / cap
        self.partial += batch < cap
        self.obs_dwell_sum += obs_dwell_sum
        self.wait_s += waited_s

    def on_send(self, count: int, action_dwell_sum: float) -> None:
        self.actions += count
        self.action_dwell_sum += action_dwell_sum

    def as_dict(self) -> dict:
        elapsed = max(time.monotonic() - self.t0, 1e-9)
        steps = int(self._arena.step_count.sum()) - self._step_count0
        step_time = float(self._arena.step_time.sum()) - self._step_time0
        b = max(self.batches, 1)
        return {
            "frames": self.frames,
            "batches": self.batches,
            "fps": self.frames / elapsed,
            "elapsed_s": elapsed,
            "batch_fill_ratio": self.fill_sum / b,
            "partial_batch_fraction": self.partial / b,
            "mean_batch_size": self.frames / b,
            "obs_to_batch_dwell_s": self.obs_dwell_sum / max(self.frames, 1),
            "batch_to_action_dwell_s": self.action_dwell_sum / max(self.actions, 1),
            "consumer_busy_fraction": float(np.clip(1.0 - self.wait_s / elapsed, 0.0, 1.0)),
            "env_step_time_s": step_time / max(steps, 1),
            "env_steps": steps,
        }
