"""State shared between a server and its owner: weight updates (seqlock) and the stats block.

Thread mode keeps both in ordinary memory; process mode maps them from two anonymous
``memfd`` files, so nothing is pickled after start-up and nothing can leak under
``/dev/shm``.

Weights (process mode): the server process lays its parameters out once (it built the
policy); the owner writes a new set under a per-policy sequence word (odd while writing),
the server checks the word before each batch and, when it changed, copies the set into a
private buffer, re-checks the word (a torn read is dropped and retried at the next batch) and
only then copies it into the policy. A batch is thus always served by one complete set of
weights, and the version stamped on it is that set's version.
"""
from __future__ import annotations

import mmap
import os
import threading
import time
from typing import Dict, List, Optional, Tuple

import numpy as np
import torch

__all__ = ["LocalWeights", "SharedWeights", "StatsBlock", "STAT_KEYS"]

_ALIGN = 64
_HEADER = 64  # bytes per policy: int64 seq, int64 version


def _align(n):
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


def _dtype_from_str(text: str) -> torch.dtype:
    name = text.replace("torch.", "")
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {text!r} in the weight layout.")
    return dtype


# -- weights ------------------------------------------------------------------------------------
class LocalWeights:
    """Weight updates handed from the owner thread to the serving thread."""

    def __init__(self, names):
        self._cond = threading.Condition()
        self._pending: Dict[str, Tuple[Dict[str, torch.Tensor], int]] = {}
        self.applied = {n: 0 for n in names}

    def publish(self, name, flat, version) -> None:
        with self._cond:
            self._pending[name] = (flat, version)

    def poll(self):
        if not self._pending:  # a plain dict read: no lock on the hot path
            return ()
        with self._cond:
            items = [(n, f, v) for n, (f, v) in self._pending.items()]
            self._pending.clear()
        return items

    def mark_applied(self, name, version) -> None:
        with self._cond:
            self.applied[name] = version
            self._cond.notify_all()

    def wait_applied(self, name, version, timeout, alive) -> bool:
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while self.applied[name] < version:
                if not alive():
                    return False
                remaining = 0.05 if deadline is None else min(0.05, deadline - time.monotonic())
                if remaining <= 0:
                    return False
                self._cond.wait(remaining)
        return True


class SharedWeights:
    """Per-policy parameter sets in one shared ``memfd`` (see the module docstring).

    Create it in the server process with :meth:`create` (which sizes the file and writes the
    initial weights), describe it to the owner with :attr:`layout` (plain JSON-able data),
    and map it in the owner with :meth:`attach`.

    Examples:
        >>> import os, torch
        >>> from torchrl_asyncpool.inference._shared import SharedWeights
        >>> fd = os.memfd_create("w", os.MFD_CLOEXEC)
        >>> server = SharedWeights.create(fd, {"pi": {"w": torch.zeros(3)}})
        >>> owner = SharedWeights.attach(fd, server.layout)
        >>> owner.publish("pi", {"w": torch.ones(3)}, version=1)
        >>> [(name, flat["w"].tolist(), v) for name, flat, v in server.poll()]
        [('pi', [1.0, 1.0, 1.0], 1)]
        >>> server.poll()
        []
        >>> server.close(); owner.close(); os.close(fd)
    """

    def __init__(self, fd: int, layout: dict):
        self.layout = layout
        size = max(int(layout["nbytes"]), _ALIGN)
        self._mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        raw = torch.frombuffer(self._mm, dtype=torch.uint8)
        self._headers = {}
        self._views: Dict[str, List[Tuple[str, torch.Tensor]]] = {}
        self._seen = {}
        for name, entry in layout["policies"].items():
            off = int(entry["header"])
            self._headers[name] = raw[off : off + 16].view(torch.int64).numpy()
            views = []
            for pname, shape, dtype, offset, nbytes in entry["tensors"]:
                dt = _dtype_from_str(dtype)
                views.append((pname, raw[offset : offset + nbytes].view(dt).view(tuple(shape))))
            self._views[name] = views
            self._seen[name] = int(self._headers[name][0])
        self._staging = None
        self._lock = threading.Lock()

    @classmethod
    def create(cls, fd: int, policies: Dict[str, Dict[str, torch.Tensor]]) -> "SharedWeights":
        offset = 0
        layout = {"policies": {}}
        for name, flat in policies.items():
            entry = {"header": offset, "tensors": []}
            offset += _HEADER
            for pname, t in flat.items():
                nbytes = t.numel() * t.element_size()
                entry["tensors"].append([pname, list(t.shape), str(t.dtype), offset, nbytes])
                offset += _align(max(nbytes, 1))
            layout["policies"][name] = entry
        layout["nbytes"] = max(offset, _ALIGN)
        os.ftruncate(fd, layout["nbytes"])
        self = cls(fd, layout)
        for name, flat in policies.items():
            for (pname, view), t in zip(self._views[name], flat.values()):
                view.copy_(t.detach().reshape(view.shape).to("cpu"))
        self._staging = {
            name: {pname: view.clone() for pname, view in views} for name, views in self._views.items()
        }
        return self

    @classmethod
    def attach(cls, fd: int, layout: dict) -> "SharedWeights":
        return cls(fd, layout)

    def names(self, name) -> List[str]:
        return [p for p, _ in self._views[name]]

    # owner side
    def publish(self, name: str, flat: Dict[str, torch.Tensor], version: int) -> None:
        """Writes a full parameter set of ``name`` and its version (owner side, thread-safe)."""
        views = self._views[name]
        wanted = {p for p, _ in views}
        unknown, missing = sorted(set(flat) - wanted), sorted(wanted - set(flat))
        if unknown or missing:
            raise KeyError(
                f"weights for policy {name!r} do not match the served policy's parameters: "
                f"unknown {unknown[:8]}, missing {missing[:8]}."
            )
        for p, view in views:
            if tuple(flat[p].shape) != tuple(view.shape):
                raise ValueError(
                    f"weights for policy {name!r}: {p!r} has shape {tuple(flat[p].shape)}, the served policy's "
                    f"has {tuple(view.shape)}."
                )
        hdr = self._headers[name]
        with self._lock:
            seq = int(hdr[0])
            hdr[0] = seq + 1  # odd: a write is in progress
            for p, view in views:
                view.copy_(flat[p].detach().to("cpu"))
            hdr[1] = int(version)
            hdr[0] = seq + 2  # even again, after the data

    # server side
    def poll(self):
        """Returns ``[(name, flat, version)]`` for policies whose weights changed and read whole."""
        out = []
        for name, hdr in self._headers.items():
            seq = int(hdr[0])
            if seq == self._seen[name] or seq & 1:
                continue
            staging = self._staging[name]
            for p, view in self._views[name]:
                staging[p].copy_(view)
            version = int(hdr[1])
            if int(hdr[0]) != seq:
                continue  # torn: the owner wrote meanwhile; retry at the next batch
            self._seen[name] = seq
            out.append((name, staging, version))
        return out

    def close(self) -> None:
        self._views.clear()
        self._headers.clear()


# -- stats --------------------------------------------------------------------------------------
#: Keys of :meth:`InferenceServer.stats` and what they mean.
STAT_KEYS = {
    "batches": "policy calls (one per batch key and bucket-sized chunk)",
    "frames": "records answered",
    "batches_per_s": "policy calls per second of wall time since the last reset",
    "frames_per_s": "records answered per second",
    "mean_batch_size": "valid records per policy call",
    "padding_fraction": "share of the rows run through the policy that were padding",
    "inference_time_s": "mean seconds per policy call, from staging to outputs on the host",
    "queueing_time_s": "mean seconds a record waited ready before the server took it",
    "service_time_s": "mean seconds from a record being ready to its answer being sent",
    "flush_wait_s": "mean seconds the server waited for a batch to fill per received batch",
    "weight_updates": "weight sets applied",
    "elapsed_s": "wall time since the last reset",
    "policy_versions": "{policy name: version currently served}",
    "per_key": "{policy name: {'batches', 'frames', 'padding_fraction', 'inference_time_s'}}",
    # TorchRL's InferenceServer.stats() keys, with its meaning (percentiles over the last
    # STATS_WINDOW records or policy calls of the window)
    "requests": "records answered (TorchRL's name for frames)",
    "requests_per_s": "records answered per second (TorchRL's name for frames_per_s)",
    "avg_batch_size": "valid records per policy call (TorchRL's name for mean_batch_size)",
    "p50_queue_ms": "median milliseconds a record waited ready before the server took it",
    "p95_queue_ms": "95th percentile of the same",
    "p50_forward_ms": "median milliseconds per policy call, from staging to outputs on the host",
    "p95_forward_ms": "95th percentile of the same",
    "policy_version": "latest version published for the first (default) policy (served from its next batch)",
}
#: records (queue times) and policy calls (forward times) the percentiles of STAT_KEYS cover at
#: most: TorchRL's default ``InferenceServerConfig.stats_window_size``
STATS_WINDOW = 1024

_G_BATCHES, _G_FRAMES, _G_ROWS, _G_POLICY, _G_QUEUE, _G_SERVICE, _G_WAIT, _G_RECV, _G_UPDATES, _G_STATE = range(10)
# how many values were ever written to the queue-time and forward-time rings (after the per-key block)
_G_QUEUE_N, _G_FORWARD_N = 10, 11
_GLOBAL = 16
_PER_KEY = 8
_K_BATCHES, _K_FRAMES, _K_ROWS, _K_POLICY, _K_VERSION = range(5)

STATE_STARTING, STATE_SERVING, STATE_STOPPED, STATE_FAILED = 0, 1, 2, 3


class StatsBlock:
    """The server's metric sums: written by the server only, read anywhere with a baseline."""

    def __init__(self, names, array: Optional[np.ndarray] = None):
        self.names = list(names)
        self.size = self._rings_at(len(self.names)) + 2 * STATS_WINDOW
        self.array = np.zeros(self.size, dtype=np.float64) if array is None else array
        # the server adds through a memoryview: half the cost of numpy's scalar +=, per batch
        self._sums = memoryview(self.array)
        # the last STATS_WINDOW queue times (seconds, per record) and policy call times (per call)
        at = self._rings_at(len(self.names))
        self._queue_ring = self.array[at:at + STATS_WINDOW]
        self._forward_ring = self.array[at + STATS_WINDOW:at + 2 * STATS_WINDOW]
        self.reset_baseline()

    @staticmethod
    def _rings_at(num_keys) -> int:
        return _GLOBAL + _PER_KEY * num_keys

    @classmethod
    def nbytes_for(cls, num_keys) -> int:
        return (cls._rings_at(num_keys) + 2 * STATS_WINDOW) * 8

    @classmethod
    def from_fd(cls, fd, names) -> "StatsBlock":
        size = cls.nbytes_for(len(names))
        mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        block = cls(names, np.frombuffer(mm, dtype=np.float64))
        block._mm = mm
        return block

    # server side
    def record_recv(self, waited, queue_sum):
        a = self._sums
        a[_G_WAIT] += waited
        a[_G_QUEUE] += queue_sum
        a[_G_RECV] += 1

    def record_queue_times(self, waits: np.ndarray):
        """Adds the per-record queue times (seconds) of one received batch to their ring."""
        n = len(waits)
        if n > STATS_WINDOW:
            waits, n = waits[-STATS_WINDOW:], STATS_WINDOW
        start = int(self._sums[_G_QUEUE_N]) % STATS_WINDOW
        first = min(n, STATS_WINDOW - start)
        ring = self._queue_ring
        ring[start:start + first] = waits[:first]
        if first < n:
            ring[:n - first] = waits[first:]
        self._sums[_G_QUEUE_N] += n

    def record_batch(self, k, b, rows, policy_s, service_sum):
        a = self._sums
        self._forward_ring[int(a[_G_FORWARD_N]) % STATS_WINDOW] = policy_s
        a[_G_FORWARD_N] += 1
        a[_G_BATCHES] += 1
        a[_G_FRAMES] += b
        a[_G_ROWS] += rows
        a[_G_POLICY] += policy_s
        a[_G_SERVICE] += service_sum
        o = _GLOBAL + _PER_KEY * k
        a[o + _K_BATCHES] += 1
        a[o + _K_FRAMES] += b
        a[o + _K_ROWS] += rows
        a[o + _K_POLICY] += policy_s

    def policy_sums(self) -> tuple:
        """``(seconds in the policy, records served, policy calls)`` since the server started."""
        a = self._sums
        return float(a[_G_POLICY]), int(a[_G_FRAMES]), int(a[_G_BATCHES])

    def set_version(self, k, version):
        self.array[_GLOBAL + _PER_KEY * k + _K_VERSION] = version

    def record_update(self):
        self.array[_G_UPDATES] += 1

    def set_state(self, state):
        self.array[_G_STATE] = state

    @property
    def state(self) -> int:
        return int(self.array[_G_STATE])

    def version(self, k) -> int:
        return int(self.array[_GLOBAL + _PER_KEY * k + _K_VERSION])

    # reader side
    def reset_baseline(self):
        self._t0 = time.monotonic()
        self._base = self.array.copy()

    def as_dict(self) -> dict:
        a = self.array.copy()
        d = a - self._base
        elapsed = max(time.monotonic() - self._t0, 1e-9)
        batches, frames, rows = int(d[_G_BATCHES]), int(d[_G_FRAMES]), float(d[_G_ROWS])
        out = {
            "batches": batches,
            "frames": frames,
            "batches_per_s": batches / elapsed,
            "frames_per_s": frames / elapsed,
            "mean_batch_size": frames / max(batches, 1),
            "padding_fraction": (rows - frames) / rows if rows else 0.0,
            "inference_time_s": float(d[_G_POLICY]) / max(batches, 1),
            "queueing_time_s": float(d[_G_QUEUE]) / max(frames, 1),
            "service_time_s": float(d[_G_SERVICE]) / max(frames, 1),
            "flush_wait_s": float(d[_G_WAIT]) / max(int(d[_G_RECV]), 1),
            "weight_updates": int(d[_G_UPDATES]),
            "elapsed_s": elapsed,
            "policy_versions": {},
            "per_key": {},
            "requests": frames,
            "requests_per_s": frames / elapsed,
            "avg_batch_size": frames / max(batches, 1),
        }
        rings = (("queue", self._queue_ring, _G_QUEUE_N), ("forward", self._forward_ring, _G_FORWARD_N))
        for name, ring, count in rings:
            recent = _recent(ring, int(a[count]), int(d[count]))
            out[f"p50_{name}_ms"] = _percentile(recent, 0.50) * 1e3
            out[f"p95_{name}_ms"] = _percentile(recent, 0.95) * 1e3
        for k, name in enumerate(self.names):
            o = _GLOBAL + _PER_KEY * k
            kb, kf, kr = int(d[o + _K_BATCHES]), int(d[o + _K_FRAMES]), float(d[o + _K_ROWS])
            out["policy_versions"][name] = int(a[o + _K_VERSION])
            out["per_key"][name] = {
                "batches": kb,
                "frames": kf,
                "padding_fraction": (kr - kf) / kr if kr else 0.0,
                "inference_time_s": float(d[o + _K_POLICY]) / max(kb, 1),
            }
        return out


def _recent(ring: np.ndarray, written: int, since_reset: int) -> np.ndarray:
    """The values of ``ring`` written since the reader's last reset (at most its length), given
    how many were ``written`` in all: the newest ends just before ``written % len(ring)``."""
    n = min(since_reset, written, len(ring))
    end = written % len(ring)
    if n <= end:
        return ring[end - n:end].copy()
    return np.concatenate([ring[len(ring) - (n - end):], ring[:end]])


def _percentile(values: np.ndarray, q: float) -> float:
    """TorchRL's percentile (the sorted value at ``round((n - 1) * q)``); ``0.0`` when empty."""
    if not len(values):
        return 0.0
    return float(np.sort(values)[int(round((len(values) - 1) * q))])
