"""Which exchange a consumer runs: the pure-Python reference or the optional C engine.

The consumer's two hot operations run in an *engine*, one call each: ``lease`` (scan the state
words, take the oldest ready slots up to the cap, copy their records into the staging buffer,
mark them leased) and ``answer`` (copy the actions into the response fields, mark the slots
answered, ring each worker once), plus ``scan`` (count the states). There are two engines with
one interface: the C ``Engine`` of the extension ``torchrl_asyncpool.exchange._native`` (built
from ``torchrl_asyncpool/exchange/csrc/`` with the package when a C compiler and the Python
headers are there) and the pure-Python
:class:`~torchrl_asyncpool.exchange.reference_engine.ReferenceEngine`, its executable
specification. :func:`build_engine` returns one or the other; everything around them (argument
checks, TensorDicts, errors) stays in
:class:`~torchrl_asyncpool.exchange.consumer.SlotConsumer`, which calls either the same way.

The names, as :class:`~torchrl_asyncpool.AsyncEnvPool`'s ``exchange`` argument takes them:

* ``"auto"`` (default): the C engine when it is built and every field of the slot layout is
  one numpy can view (bfloat16 fields, say, are not), else Python;
* ``"native"``: the C engine, or a clear error saying why it cannot run;
* ``"python"``: the pure-Python engine (the reference implementation).

The environment variable ``TORCHRL_ASYNCPOOL_EXCHANGE`` overrides ``"auto"`` (not an explicit
choice), e.g. to compare the two on the same script.
"""
from __future__ import annotations

import os
from typing import Optional, Sequence

import numpy as np

from torchrl_asyncpool.exchange.metrics import STAT_SLOTS

__all__ = ["EXCHANGES", "native_available", "resolve_exchange", "describe_exchange", "build_engine", "row_copier",
           "pass_stores", "step_group", "copy_into", "fit_rows"]

#: the accepted values of a pool's ``exchange=`` (see :func:`resolve_exchange`)
EXCHANGES = ("auto", "native", "python")

try:
    from torchrl_asyncpool.exchange import _native
except ImportError as exc:  # not built (no compiler at install time) or built for another Python
    _native = None
    _IMPORT_ERROR: Optional[str] = str(exc)
else:
    _IMPORT_ERROR = None

_ENV_VAR = "TORCHRL_ASYNCPOOL_EXCHANGE"


def native_available() -> bool:
    """Whether the C engine was built for this interpreter.

    Examples:
        >>> from torchrl_asyncpool.exchange.native import native_available
        >>> isinstance(native_available(), bool)
        True
    """
    return _native is not None


def resolve_exchange(exchange: str) -> str:
    """Validates an ``exchange`` argument; ``"auto"`` may be overridden by the environment.

    Returns ``"auto"``, ``"native"`` or ``"python"``. ``"native"`` without the built engine
    raises :class:`ImportError` with the reason and the fix.

    Examples:
        >>> from torchrl_asyncpool.exchange.native import resolve_exchange
        >>> resolve_exchange("python")
        'python'
        >>> resolve_exchange("shm")
        Traceback (most recent call last):
        ...
        ValueError: exchange must be one of ('auto', 'native', 'python'), got 'shm'.
    """
    if exchange not in EXCHANGES:
        raise ValueError(f"exchange must be one of {EXCHANGES}, got {exchange!r}.")
    if exchange == "auto":
        override = os.environ.get(_ENV_VAR, "").strip()
        if override:
            if override not in EXCHANGES:
                raise ValueError(f"${_ENV_VAR} must be one of {EXCHANGES}, got {override!r}.")
            exchange = override
    if exchange == "native" and _native is None:
        raise ImportError(
            "exchange='native' needs the C extension torchrl_asyncpool.exchange._native, which is not "
            f"importable here ({_IMPORT_ERROR}). It is built when the package is installed on a machine "
            "with a C compiler and the Python headers (pip install -e . again after installing them); "
            "exchange='auto' falls back to the pure-Python exchange."
        )
    return exchange


def describe_exchange(exchange: str = "auto") -> str:
    """What ``exchange`` (resolved here) runs on this install, in words, for logs and ``--version``;
    never raises (a bad name or ``$TORCHRL_ASYNCPOOL_EXCHANGE`` is described, not raised).

    Examples:
        >>> from torchrl_asyncpool.exchange.native import describe_exchange
        >>> describe_exchange("python")
        'pure Python'
    """
    try:
        exchange = resolve_exchange(exchange)
    except (ValueError, ImportError) as exc:
        return f"none: {exc}"
    if _enabled(exchange):
        return "C engine"
    return "pure Python" if _native is not None else "pure Python: the C engine was not built"


def _enabled(exchange: str) -> bool:
    """Whether a resolved ``exchange`` may use the C engine here."""
    return exchange != "python" and _native is not None


def build_engine(exchange: str, arena, staging_env_index: np.ndarray, gathers: Sequence, responses: Sequence,
                 bell_fds: Sequence[int], slot_bell: np.ndarray):
    """The consumer engine over these buffers: the C ``Engine``, or the pure-Python
    :class:`~torchrl_asyncpool.exchange.reference_engine.ReferenceEngine` (same interface and
    results: ``lease``, ``answer``, ``scan``).

    Args:
        exchange (str): a resolved name (see :func:`resolve_exchange`).
        arena (Arena): the mapped arena (state, ready and lease times, consumer stats).
        staging_env_index (np.ndarray): the staging buffer's int64 ``[n]`` env index.
        gathers (sequence): ``(key, src, dst)`` per request field a batch carries: the slot
            field and the staging field, CPU tensors.
        responses (sequence): ``(key, dst)`` per response field, a CPU tensor.
        bell_fds (sequence of int): the workers' doorbell descriptors.
        slot_bell (np.ndarray): slot -> index in ``bell_fds``.

    Raises:
        ValueError: ``exchange="native"`` and a field the C engine cannot copy (named).
    """
    from torchrl_asyncpool.exchange.gather import numpy_or_none

    gathers = [(key, numpy_or_none(src), numpy_or_none(dst), src, dst) for key, src, dst in gathers]
    responses = [(key, numpy_or_none(dst), dst) for key, dst in responses]
    slot_bell = np.ascontiguousarray(slot_bell, dtype=np.int64)
    args = (arena.state, arena.ready_time, arena.lease_time, staging_env_index)
    tail = ([int(fd) for fd in bell_fds], slot_bell, arena.consumer_stats, STAT_SLOTS)
    unfit = [key for key, src, dst, _, _ in gathers if not (_plain(src) and _plain(dst))]
    unfit += [key for key, dst, _ in responses if not _plain(dst)]
    if _enabled(exchange) and unfit and exchange == "native":
        raise ValueError(
            f"exchange='native' copies raw rows of numpy-viewable CPU buffers; the fields {unfit} are not "
            "(a dtype numpy lacks, such as bfloat16). Use exchange='auto' or 'python'."
        )
    if _enabled(exchange) and not unfit:
        return _native.Engine(
            *args,
            [(src, dst, _row_bytes(src)) for _, src, dst, _, _ in gathers],
            [(dst, _row_bytes(dst)) for _, dst, _ in responses],
            *tail,
        )
    from torchrl_asyncpool.exchange.reference_engine import ReferenceEngine

    # numpy views where numpy has the dtype, the tensors themselves where it has not
    return ReferenceEngine(
        *args,
        [(src if src is not None else src_t, dst if dst is not None else dst_t, 0)
         for _, src, dst, src_t, dst_t in gathers],
        [(dst if dst is not None else dst_t, 0) for _, dst, dst_t in responses],
        *tail,
    )


def row_copier(exchange: str, pairs: Sequence):
    """A C copier of rows from ``src[i]`` to ``dst.reshape(-1, *row)[j]`` for every ``(src, dst)``
    pair at once, or ``None`` for numpy's own stores (``exchange="python"``, the engine not
    built, or a pair it cannot copy as raw rows).

    Args:
        exchange (str): a resolved name (see :func:`resolve_exchange`).
        pairs (sequence): ``(src, dst)`` numpy arrays: ``src`` ``[n, *row]`` (a slot field),
            ``dst`` ``[..., *row]`` of the same dtype (the matching chunk field).

    Examples:
        >>> import numpy as np
        >>> from torchrl_asyncpool.exchange.native import native_available, row_copier
        >>> src, dst = np.arange(6.0).reshape(3, 2), np.zeros((2, 2, 2))
        >>> rows = row_copier("auto", [(src, dst)])
        >>> if rows is not None:  # chunk 1, position 0 is flat row 2 of dst
        ...     rows.copy(np.array([2, 0]), np.array([2, 1]))
        ... else:
        ...     dst.reshape(-1, 2)[[2, 1]] = src[[2, 0]]
        >>> dst[1, 0].tolist(), dst[0, 1].tolist()
        ([4.0, 5.0], [0.0, 1.0])
    """
    if not _enabled(exchange):
        return None
    rows = []
    for src, dst in pairs:
        row_shape = src.shape[1:]
        if (not (_plain(src) and _plain(dst)) or src.dtype != dst.dtype
                or dst.shape[dst.ndim - len(row_shape):] != row_shape or src.nbytes == 0):
            return None
        rows.append((src, dst, _row_bytes(src)))
    return _native.Rows(rows)


def pass_stores(exchange: str, arena, reward: np.ndarray, step_type: np.ndarray, done: np.ndarray,
                terminated: np.ndarray, truncated: np.ndarray, consumer_fd: int):
    """A worker's per-pass stores (rewards, step types and end flags, step timers) and its
    publish (ready times, ``OBS_READY``, one ring of the consumer) in C, or ``None`` for numpy's
    stores (``exchange="python"``, the engine not built, or a reward that is not one float32
    per slot).

    Args:
        exchange (str): a resolved name (see :func:`resolve_exchange`).
        arena (Arena): the worker's mapping (state, ready and step times, step counts).
        reward, step_type, done, terminated, truncated (np.ndarray): the request fields.
        consumer_fd (int): the consumer's doorbell.
    """
    if not _enabled(exchange):
        return None
    flags = (done, terminated, truncated)
    if (reward.dtype != np.float32 or reward.size != reward.shape[0] or step_type.dtype != np.int8
            or any(f.dtype != np.bool_ or f.shape != done.shape for f in flags)
            or not all(_plain(a) for a in (reward, step_type, *flags))):
        return None
    return _native.Pass(arena.state, arena.ready_time, reward, step_type, done, terminated, truncated,
                        arena.step_time, arena.step_count, int(consumer_fd))


def step_group(exchange: str):
    """The C steps of a pass loop's plain gymnasium envs and TorchRL ``GymEnv`` factories on
    the fast path (``csrc/step_loop.c``), or ``None`` for the Python loop (``exchange="python"``
    or the engine not built).

    The function, ``step_group(stepper, fast, start, idx, sts, rewards, times, slow_s, hold_s)``,
    steps ``fast[start:]`` (one tuple per slot, see ``workers.stepper._fast_step``), copies
    each observation into its slot's row (a float64 one into a float32 row by a cast; by
    :func:`fit_rows` where it is not an array of the row's dtype and shape otherwise), advances
    a slot's step count and reward sum where its tuple carries them (TorchRL's ``StepCounter``,
    truncating at its ``max_steps``, and ``RewardSum``: state and row arrays) and appends each
    record to the four staging lists a
    :class:`~torchrl_asyncpool.workers.record_writer.RecordWriter` hands out for it
    (``RecordWriter.plain_staging``: only while its ``add`` would append nothing more, i.e.
    no recurrent inputs and no restart flags), as its ``add`` does; it
    stops after a step slower than ``slow_s`` or once ``hold_s`` has passed, and returns
    ``(stepped, positions of the slots whose episode ended)``. A step that raises sets
    ``stepper.current`` to its slot's index and propagates.

    Args:
        exchange (str): a resolved name (see :func:`resolve_exchange`).

    Examples:
        >>> import gymnasium as gym, numpy as np
        >>> from torchrl_asyncpool.exchange.native import step_group
        >>> run = step_group("native")
        >>> env = gym.make("CartPole-v1"); _ = env.reset(seed=0)
        >>> action, obs = np.ones((), np.int64), np.zeros(4, np.float32)
        >>> lists = [], [], [], []
        >>> if run is not None:
        ...     stepped, ended = run(None, [(7, env.step, action, None, obs, None, None)], 0, *lists, 1.0, 1.0)
        ... else:  # what it does, in Python
        ...     o, r, term, trunc, _ = env.step(action[()]); obs[...] = o
        ...     stepped, ended = 1, []
        ...     for lst, v in zip(lists, (7, 1, r, 0.0)): lst.append(v)
        >>> stepped, ended, lists[0], lists[1], bool(obs.any())
        (1, [], [7], [1], True)
    """
    return _native.step_group if _enabled(exchange) else None


def _plain(a) -> bool:
    return a is not None and a.flags.c_contiguous and a.flags.writeable


def _row_bytes(a: np.ndarray) -> int:
    return a.nbytes // a.shape[0]


#: dtype kinds an observation may come in (bool, integers, floats, complex): numpy casts them to the
#: row's; anything else (None, strings, objects) is refused
_NUMBER_KINDS = frozenset("biufc")


def fit_rows(dst: np.ndarray, src, key=None, rows=None) -> None:
    """``dst[...] = src`` for a value that must have ``dst``'s shape: numpy casts its dtype to
    ``dst``'s, but a value of another shape (which numpy would broadcast: a scalar, ``(1, n)`` for
    ``(n,)``) or not numeric (``None`` would become NaN) is refused with a ``ValueError`` naming
    both layouts, before anything is written. The workers' observation copies end here whenever
    the value is not already an array of the row's dtype and shape.

    Args:
        dst (np.ndarray): the slot's row (its shape and dtype come from the env's spec).
        src: the value the env returned (an array, a list, a number).
        key (optional): the observation entry, named in the error (a Dict space's key).
        rows (optional): an index of ``dst``'s first axis: only those rows are written (the
            envs of a vector env that were stepped), from the same rows of ``src``, which must
            still have ``dst``'s whole shape.

    Examples:
        >>> import numpy as np
        >>> from torchrl_asyncpool.exchange.native import fit_rows
        >>> row = np.zeros(3, np.float32)
        >>> fit_rows(row, [1, 2, 3]); row.tolist()  # converted: the same shape
        [1.0, 2.0, 3.0]
        >>> fit_rows(row, np.ones((1, 3)))  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: the env returned an observation of shape (1, 3) and dtype float64 where ... (3,) ...
        >>> fit_rows(row, None, key="pixels")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: the env returned 'pixels' as None where its observation spec declares shape (3,) ...
    """
    value = np.asarray(src)
    if value.shape == dst.shape and value.dtype.kind in _NUMBER_KINDS:
        if rows is None:
            dst[...] = value
        else:
            dst[rows] = value[rows]
        return
    what = "an observation" if key is None else repr(key)
    if src is None:
        given = "as None"
    elif value.dtype.kind == "O":  # not an array of numbers: say what it is
        given = f"as a {type(src).__name__} ({src!r:.60})"
    else:
        given = f"of shape {value.shape} and dtype {value.dtype}"
    raise ValueError(f"the env returned {what} {given} where its observation spec declares shape "
                     f"{dst.shape} and dtype {dst.dtype}.")


if _native is not None:
    _copy_into = _native.copy_into
    _native.set_obs_fallback(fit_rows)

    def copy_into(dst: np.ndarray, src, key=None) -> None:
        """``dst[...] = src``, by one ``memcpy`` that keeps the GIL when both are C-contiguous
        arrays of the same dtype and shape of 500 elements to 256 KiB (numpy's own copy, which
        lets the GIL go above 500 elements, otherwise; a value of another dtype is converted,
        one of another shape refused, see :func:`fit_rows`, whose error names ``key``). An
        observation copy in a threaded worker that lets the GIL go is taken over by another env
        thread, and the copy then waits for that thread's Python run. Used whatever the exchange
        (it is the workers' copy, not the consumer's).

        Examples:
            >>> import numpy as np
            >>> from torchrl_asyncpool.exchange.native import copy_into
            >>> dst = np.zeros((2, 2), np.uint8)
            >>> copy_into(dst, np.full((2, 2), 7, np.uint8)); copy_into(dst[0], [1, 2])  # the second converts
            >>> dst.tolist()
            [[1, 2], [7, 7]]
        """
        # up to 500 elements numpy keeps the GIL itself, and its copy of a fresh array costs less
        # than exporting that array's buffer
        if dst.size <= 500:
            if src.__class__ is np.ndarray and src.shape == dst.shape and src.dtype.kind in _NUMBER_KINDS:
                dst[...] = src
            else:
                fit_rows(dst, src, key)
        elif not _copy_into(dst, src):
            fit_rows(dst, src, key)
else:
    def copy_into(dst: np.ndarray, src, key=None) -> None:
        """``dst[...] = src`` (the C extension is not built: numpy's copy), as :func:`fit_rows`
        checks it."""
        fit_rows(dst, src, key)
