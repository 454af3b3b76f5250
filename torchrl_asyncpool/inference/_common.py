"""Configuration, batch keys, bucket ladders and errors shared by the thread and process servers."""
from __future__ import annotations

import functools
import hashlib
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from torchrl_asyncpool.exchange.arena import as_key, key_repr  # noqa: F401 - the server modules import them from here

__all__ = [
    "InferenceServerError",
    "BatchKey",
    "bucket_ladder",
    "config_hash",
    "ServerSpec",
]

DEFAULT_POLICY_NAME = "policy"


class InferenceServerError(RuntimeError):
    """The inference server stopped serving: a policy raised, its process died, or the pool failed.

    Attributes:
        key (tuple or None): the batch key ``(policy name, config hash)`` being served when the
            error happened, when there is one.
        server_traceback (str): the traceback text formatted where the error happened (in the
            server thread or the server process); empty when the server process was killed.
    """

    def __init__(self, message: str, key: Optional[Tuple[str, str]] = None, server_traceback: str = ""):
        self.key = key
        self.server_traceback = server_traceback
        text = message if not server_traceback else f"{message}\nserver traceback:\n{server_traceback}"
        super().__init__(text)
        self.message = message

    def __reduce__(self):
        return (type(self), (self.message, self.key, self.server_traceback))


@dataclass(frozen=True)
class BatchKey:
    """The key that decides which slots may share a batch: ``(policy name, config hash)``.

    Two slots are batched together only when their keys are equal; the hash covers the
    serving configuration of the policy (its factory or class, the ``policy_configs`` entry
    given to the server, the bucket ladder), so two entries that look alike but would run
    differently never share a forward pass.

    Examples:
        >>> from torchrl_asyncpool.inference import BatchKey
        >>> key = BatchKey("actor", "0123456789ab")
        >>> tuple(key)
        ('actor', '0123456789ab')
    """

    name: str
    config_hash: str

    def __iter__(self):
        return iter((self.name, self.config_hash))

    def __str__(self):
        return f"({self.name!r}, {self.config_hash!r})"


def config_hash(name: str, policy_or_factory: Any, config: Optional[Mapping], buckets) -> str:
    """A short, stable hash of what decides how a policy is served.

    Examples:
        >>> from torchrl_asyncpool.inference._common import config_hash
        >>> config_hash("a", None, {"ckpt": "x"}, (1, 2)) == config_hash("a", None, {"ckpt": "x"}, (1, 2))
        True
        >>> config_hash("a", None, {"ckpt": "x"}, (1, 2)) == config_hash("a", None, {"ckpt": "y"}, (1, 2))
        False
    """
    target = getattr(policy_or_factory, "fn", policy_or_factory)  # CloudpickleWrapper
    ident = _ident(target)
    payload = {
        "name": name,
        "target": ident,
        "config": config if config is not None else {},
        "buckets": list(buckets) if buckets is not None else None,
    }
    text = json.dumps(payload, sort_keys=True, default=repr)
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def _ident(target) -> str:
    if isinstance(target, functools.partial):
        return f"{_ident(target.func)}(*{target.args!r}, **{target.keywords!r})"
    if isinstance(target, torch.nn.Module) or not hasattr(target, "__qualname__"):
        kind = type(target)
        return f"{kind.__module__}.{kind.__qualname__}"
    return f"{getattr(target, '__module__', '')}.{target.__qualname__}"


def bucket_ladder(max_rows: int, spec="auto") -> Optional[Tuple[int, ...]]:
    """The padded batch sizes for a key whose batches hold at most ``max_rows`` records.

    Args:
        max_rows (int): the most records one batch of the key holds.
        spec ("auto", None or sequence of int): ``"auto"``: powers of two below ``max_rows``,
            plus ``max_rows`` itself. ``None``: no padding. A sequence: those sizes, sorted;
            batches larger than the largest are split. Defaults to ``"auto"``.

    Returns:
        tuple of int, or ``None`` (no padding).

    Raises:
        ValueError: ``spec`` is another string, an empty sequence or holds a size that is not a
            positive int.

    Examples:
        >>> from torchrl_asyncpool.inference import bucket_ladder
        >>> bucket_ladder(12)
        (1, 2, 4, 8, 12)
        >>> bucket_ladder(8)
        (1, 2, 4, 8)
        >>> bucket_ladder(8, (8, 2))
        (2, 8)
        >>> bucket_ladder(8, None) is None
        True
    """
    if spec is None:
        return None
    if isinstance(spec, str):
        if spec != "auto":
            raise ValueError(f"bucket_sizes must be 'auto', None or a sequence of ints, got {spec!r}.")
        ladder = []
        b = 1
        while b < max_rows:
            ladder.append(b)
            b *= 2
        ladder.append(max_rows)
        return tuple(ladder)
    if not isinstance(spec, Sequence) or not len(spec):
        raise ValueError(f"bucket_sizes must be 'auto', None or a non-empty sequence of ints, got {spec!r}.")
    for b in spec:
        if isinstance(b, bool) or not isinstance(b, int) or b < 1:
            raise ValueError(f"bucket sizes must be positive ints, got {spec!r}.")
    return tuple(sorted(set(spec)))


def pick_bucket(ladder: Optional[Tuple[int, ...]], b: int) -> int:
    """The smallest bucket holding ``b`` rows (``b`` itself without a ladder)."""
    if ladder is None:
        return b
    for size in ladder:
        if size >= b:
            return size
    return ladder[-1]


@dataclass
class KeyPlan:
    """Everything the serving loop needs about one batch key (picklable, no policy object)."""

    index: int
    name: str
    config_hash: str
    slots: List[int]
    buckets: Optional[Tuple[int, ...]]
    max_rows: int  # largest batch the runner stages at once (largest bucket, or #slots unpadded)

    @property
    def key(self) -> Tuple[str, str]:
        return (self.name, self.config_hash)


@dataclass
class ServerSpec:
    """The server configuration after validation, as it travels to a server process."""

    names: List[str]
    plans: List[KeyPlan]
    slot_key: List[int]  # key index per slot
    min_get: int
    max_get: Optional[int]
    timeout: float
    device: str
    cuda_graphs: bool
    policy_version_key: Any
    stamp_version: bool
    overlap: bool
    num_threads: Optional[int] = 1
    factories: Dict[str, Callable] = field(default_factory=dict)
    on_batch: Optional[Callable] = None
    flush_fraction: float = 0.5
    initial_versions: Dict[str, int] = field(default_factory=dict)
    cpu_affinity: Optional[Tuple[int, ...]] = None  # where the policies run (thread or process)
    auto_timeout: bool = False  # timeout="auto": the deadline follows the measured env step (auto_flush_timeout)

    @property
    def feeds_leased_batch(self) -> bool:
        """Whether the serving loop hands the leased batch itself to the policy: one key, served
        unpadded (no bucket ladder), not on CUDA, without double buffering. Otherwise each key's
        runner gathers its records straight from the (leased, so stable) slots into its own
        staging, and the lease copies no record (``lease_keys``): one gather per record."""
        return (len(self.plans) == 1 and self.plans[0].buckets is None and not self.overlap
                and torch.device(self.device).type != "cuda")

    def lease_keys(self, keys):
        """The request keys the serving loop's consumer copies at lease: ``keys`` (the keys the
        policies read, ``None`` for all) when the leased batch feeds the policy, none otherwise."""
        return keys if self.feeds_leased_batch else ()



def check_positive_int(name, value, allow_none=False):
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int{' or None' if allow_none else ''}, got {value!r}.")
    return value


def resolve_slot_keys(slot_keys, names: List[str], hashes: Dict[str, str], num_envs: int) -> List[int]:
    """Maps each slot to the index of its batch key, or raises a clear ``ValueError``."""
    if slot_keys is None:
        if len(names) != 1:
            raise ValueError(
                f"several policies are served ({names}): pass slot_keys, one policy name per env slot."
            )
        return [0] * num_envs
    if isinstance(slot_keys, (str, bytes)) or not isinstance(slot_keys, Sequence):
        raise ValueError(f"slot_keys must be a sequence with one entry per env slot, got {type(slot_keys).__name__}.")
    if len(slot_keys) != num_envs:
        raise ValueError(f"slot_keys has {len(slot_keys)} entries but the pool has {num_envs} env slots.")
    out = []
    known = {n: i for i, n in enumerate(names)}
    for slot, entry in enumerate(slot_keys):
        if isinstance(entry, BatchKey):
            entry = tuple(entry)
        if isinstance(entry, tuple):
            if len(entry) != 2:
                raise ValueError(f"slot {slot} is bound to {entry!r}; a key is (policy name, config hash).")
            name, digest = entry
            if name not in known or hashes[name] != digest:
                raise ValueError(
                    f"slot {slot} is bound to unknown batch key {entry!r}; known keys: "
                    f"{[(n, hashes[n]) for n in names]}."
                )
        else:
            name = entry
            if not isinstance(name, str):  # a list is unhashable: `in known` would raise a bare TypeError
                raise ValueError(
                    f"slot {slot} is bound to {entry!r} ({type(entry).__name__}); an entry of slot_keys is a "
                    "policy name, a BatchKey or a (policy name, config hash) tuple."
                )
            if name not in known:
                raise ValueError(f"slot {slot} is bound to unknown policy {name!r}; known policies: {names}.")
        out.append(known[name])
    return out


#: ``timeout="auto"``: envs whose mean step (measured in the workers) takes at least this long get
#: a candidate flush deadline (tried against greedy, see flush_deadline.py); cheaper envs are
#: served greedily without trying (CartPole: ~10 us; a deadline only idles them). The same line
#: as the CPU partition's (collector/workload_plan.py): from here on the envs are the work
BATCHING_STEP_S = 80e-6
#: the deadline is this fraction of the mean env step (per env a worker steps in turn) ...
AUTO_TIMEOUT_FRACTION = 0.375
#: ... at most this many seconds, per env a worker steps in turn
MAX_AUTO_TIMEOUT_S = 0.005


def auto_flush_timeout(mean_step_s: float, envs_in_turn: float = 1.0) -> float:
    """The flush deadline of ``timeout="auto"`` for envs whose mean step takes ``mean_step_s``,
    stepped ``envs_in_turn`` at a time one after the other by each worker (its envs per worker;
    ``1`` for envs stepped in threads of their own).

    A batch costs the serving loop about the same whatever its size (on CPU, ~0.1 ms of Python
    and TensorDict work before the policy's own compute), and that time is taken from the env
    workers on a machine with few cores. With cheap envs (CartPole: ~10 us a step) records
    arrive faster than batches are served and form the next batch anyway, so the loop is
    greedy (``0``). With envs whose step costs as much as a batch or more (Atari through
    gymnasium: ~1.3 ms; a simulator), a greedy loop answers batches of about one record. A
    worker that steps ``k`` envs in turn comes back to an env only after stepping the ``k - 1``
    others, so that env's answer may wait that long without idling anything: the deadline is
    ``k`` times ``AUTO_TIMEOUT_FRACTION`` of a step (a margin for uneven steps), at most ``k``
    times ``MAX_AUTO_TIMEOUT_S``. An env stepped alone (``k = 1``) idles its worker while its
    answer waits, hence the cap per env; ``k`` envs in turn leave ``k - 1`` steps free, which
    the deadline never exceeds once ``k >= 2``. (A cap of 5 ms for the whole deadline gave 64
    Atari envs in 2 workers batches of ~7.5 records and cost the serving thread ~145 us of CPU
    per frame, against ~18 records and ~100 us with a deadline of 12.8 ms. A quarter of a step
    instead of three eighths gave 16 Atari envs batches of 4-6.5 records instead of ~8, and
    the serving thread ~210 us of CPU per frame instead of ~165.)

    Args:
        mean_step_s (float): the envs' mean step, in seconds.
        envs_in_turn (float): envs each worker steps one after the other. Defaults to ``1``.

    Returns:
        float: the deadline in seconds (``0.0``: greedy, for envs cheaper than
        ``BATCHING_STEP_S``).

    Examples:
        >>> from torchrl_asyncpool.inference import auto_flush_timeout
        >>> auto_flush_timeout(10e-6), auto_flush_timeout(1.2e-3), auto_flush_timeout(0.5)
        (0.0, 0.00045, 0.005)
        >>> auto_flush_timeout(1.2e-3, envs_in_turn=8)  # a worker of 8 envs stepped in turn
        0.0036
        >>> auto_flush_timeout(0.5, envs_in_turn=8)  # slow steps: capped per env in turn
        0.04
    """
    if not mean_step_s >= BATCHING_STEP_S:
        return 0.0
    return max(1.0, float(envs_in_turn)) * min(MAX_AUTO_TIMEOUT_S, AUTO_TIMEOUT_FRACTION * mean_step_s)


def auto_threshold(live: int, min_get: int, fraction: float) -> int:
    """Self-sizing flush size: a fraction of the slots in flight (SEED: half), at least ``min_get``."""
    return max(min_get, int(math.ceil(live * fraction)), 1)
