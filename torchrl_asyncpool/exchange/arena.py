"""The shared-memory slot arena: every buffer of the hot path, described in one place.

One arena per pool, allocated by the parent from the env specs and mapped by every worker.
It is a single anonymous ``memfd`` (no file under ``/dev/shm``, so nothing can leak there
even when the parent is SIGKILLed: the memory goes away with the last process mapping it).
Every field has leading dimension ``num_slots``:

=====================  ==============================  ==============================================
field                  dtype / shape (per slot)        written by
=====================  ==============================  ==============================================
``consumer_stats``     float64 ``[NUM_STATS]``         the consumer only (not per slot): metric sums
``state``              int32 ``[]``                    see :mod:`~torchrl_asyncpool.exchange.slot_states`
``ready_time``         float64 ``[]``                  worker: ``time.monotonic()`` at ``OBS_READY``
``lease_time``         float64 ``[]``                  consumer: when ``recv`` leased the slot
``step_time``          float64 ``[]``                  worker: cumulative env step+reset seconds
``step_count``         int64 ``[]``                    worker: env steps+resets done
``error_len``          int32 ``[]``                    worker: bytes of ``error_text`` (before ``ERROR``)
``restarts``           int64 ``[]``                    worker (a rebuilt env), pool (a restarted worker)
``busy_since``         float64 ``[]``                  watched worker: when its step/reset of the slot began
``busy_pos``           int64 ``[]``                    watched worker: that step's chunk row (-1: none)
``build_since``        float64 ``[]``                  watched worker: when its rebuild of the env began (0: none)
``seq``, ``length``    int64, int32 ``[]``             chunk buffers only: sequence number and fill
``error_text``         uint8 ``[ERROR_TEXT_BYTES]``    worker: UTF-8 traceback of a failed env
request fields         from the observation,           worker (observation keys, ``"reward"``,
                       reward and done specs           ``"step_type"``, ``"done"``, ``"terminated"``,
                                                       ``"truncated"``, recurrent inputs)
response fields        from the action spec and        consumer (action keys, policy outputs)
                       the declared policy outputs
=====================  ==============================  ==============================================

Fields are 64-byte aligned.
"""
from __future__ import annotations

import mmap
import os
from dataclasses import dataclass
from typing import Dict, Tuple

import numpy as np
import torch
from tensordict import TensorDict

__all__ = ["FieldSpec", "ArenaLayout", "Arena", "CONTROL_FIELDS", "ERROR_TEXT_BYTES", "NUM_STATS", "CARRY_KEY"]

#: Root of the slot entries that carry a TorchRL recurrent state from one step to the next
#: (``(CARRY_KEY, *key)`` for the policy's ``("next", *key)``); they never reach a batch. The
#: pool lays them out in the slots, the collector's acting policy fills them.
CARRY_KEY = "_carried_state"

_ALIGN = 64

#: (name, dtype) of the per-slot control words; all are scalars per slot.
CONTROL_FIELDS = (
    ("state", torch.int32),
    ("ready_time", torch.float64),
    ("lease_time", torch.float64),
    ("step_time", torch.float64),
    ("step_count", torch.int64),
    ("error_len", torch.int32),
    ("seq", torch.int64),
    ("length", torch.int32),
    ("restarts", torch.int64),  # times the slot's env was rebuilt (AsyncEnvPool(on_env_failure="restart"))
    # watched workers only (worker restarts, step_timeout; see workers/watch.py): when the
    # worker's current step or reset of the slot began
    ("busy_since", torch.float64),
    ("busy_pos", torch.int64),  # and the chunk row of the transition that step writes (-1: none)
    ("build_since", torch.float64),  # when a rebuild of the slot's env from its factory began (0: none running)
)
#: Bytes of traceback text a worker can leave per slot; longer tracebacks keep their tail.
ERROR_TEXT_BYTES = 8192
#: Length of the consumer's metric-sum vector (see ``exchange.metrics``).
NUM_STATS = 16


@dataclass(frozen=True)
class FieldSpec:
    """Shape (per slot) and dtype of one arena field."""

    key: Tuple[str, ...]
    shape: Tuple[int, ...]
    dtype: torch.dtype

    @property
    def numel(self) -> int:
        """Elements per slot (the product of ``shape``)."""
        n = 1
        for s in self.shape:
            n *= int(s)
        return n


class ArenaLayout:
    """Byte offsets of every field of the arena, computed from per-slot field specs.

    Args:
        num_slots (int): number of env slots (leading dimension of every field).
        request (dict): ``{key: (shape, dtype)}`` of the records workers publish.
        response (dict): ``{key: (shape, dtype)}`` of the records the consumer writes back.
        error_text_bytes (int, optional): traceback bytes kept per slot.
        action_keys (list, optional): the response keys that are env actions.
        recurrent (dict, optional): ``{hidden_in: hidden_out}`` pairs fed back by workers.
    """

    def __init__(self, num_slots: int, request: Dict, response: Dict, error_text_bytes: int = ERROR_TEXT_BYTES,
                 action_keys=None, recurrent=None):
        if num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {num_slots}.")
        self.num_slots = int(num_slots)
        #: response keys the env consumes (the rest are policy outputs); ``None``: all of them
        self.action_keys = None if action_keys is None else [as_key(k) for k in action_keys]
        #: ``{hidden_in key: hidden_out key}`` the workers feed back (see ``AsyncEnvPool``)
        self.recurrent = {as_key(k): as_key(v) for k, v in (recurrent or {}).items()}
        self.control = [FieldSpec((name,), (), dtype) for name, dtype in CONTROL_FIELDS]
        self.control.append(FieldSpec(("error_text",), (int(error_text_bytes),), torch.uint8))
        self.request = [
            FieldSpec(as_key(k), tuple(int(s) for s in shape), dtype) for k, (shape, dtype) in request.items()
        ]
        self.response = [
            FieldSpec(as_key(k), tuple(int(s) for s in shape), dtype) for k, (shape, dtype) in response.items()
        ]
        self.offsets: Dict[Tuple[str, Tuple[str, ...]], int] = {}
        self.offsets[("stats", ("consumer_stats",))] = 0
        offset = NUM_STATS * 8
        for section, fields in (("control", self.control), ("request", self.request), ("response", self.response)):
            for f in fields:
                self.offsets[(section, f.key)] = offset
                nbytes = self.num_slots * f.numel * _itemsize(f.dtype)
                offset += (nbytes + _ALIGN - 1) // _ALIGN * _ALIGN
        self.nbytes = max(offset, _ALIGN)

    def __repr__(self) -> str:
        return (
            f"ArenaLayout(num_slots={self.num_slots}, nbytes={self.nbytes}, "
            f"request={[(f.key, f.shape, f.dtype) for f in self.request]}, "
            f"response={[(f.key, f.shape, f.dtype) for f in self.response]})"
        )


class Arena:
    """The mapped arena: tensor (and numpy) views of every field.

    Create it in the parent with :meth:`create`, hand :attr:`fd` to workers (wrapped by
    :class:`~torchrl_asyncpool.exchange.InheritedFd`) and map it there with :meth:`attach`.

    Attributes:
        request (TensorDict): request fields, batch size ``[num_slots]``.
        response (TensorDict): response fields, batch size ``[num_slots]``.
        state, ready_time, lease_time, step_time, step_count (np.ndarray): control words.

    Examples:
        >>> import torch
        >>> from torchrl_asyncpool.exchange import Arena, ArenaLayout
        >>> layout = ArenaLayout(4, {"obs": ((3,), torch.float32)}, {"action": ((), torch.int64)})
        >>> arena = Arena.create(layout)
        >>> arena.request["obs"].shape
        torch.Size([4, 3])
        >>> twin = Arena.attach(layout, arena.fd)  # a second mapping of the same memory
        >>> twin.request["obs"][1] = 7.0
        >>> arena.request["obs"][1]
        tensor([7., 7., 7.])
        >>> arena.close(); twin.close()
    """

    def __init__(self, layout: ArenaLayout, fd: int, owner: bool):
        self.layout = layout
        self.fd = fd
        self._owner = owner
        self._mm = mmap.mmap(fd, layout.nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        raw = torch.frombuffer(self._mm, dtype=torch.uint8)
        n = layout.num_slots

        def view(section, f):
            off = layout.offsets[(section, f.key)]
            nbytes = n * f.numel * _itemsize(f.dtype)
            return raw[off : off + nbytes].view(f.dtype).view(n, *f.shape)

        for f in layout.control:
            setattr(self, f.key[0], view("control", f).numpy())
        self.consumer_stats = raw[: NUM_STATS * 8].view(torch.float64).numpy()
        self.request = TensorDict({f.key: view("request", f) for f in layout.request}, batch_size=[n])
        self.response = TensorDict({f.key: view("response", f) for f in layout.response}, batch_size=[n])
        if owner:
            self.state[:] = 0

    @classmethod
    def create(cls, layout: ArenaLayout, name: str = "torchrl_asyncpool_arena") -> "Arena":
        """Allocates a zero-filled arena for ``layout`` in a new anonymous memfd."""
        fd = os.memfd_create(name, os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, layout.nbytes)
            return cls(layout, fd, owner=True)
        except BaseException:
            os.close(fd)
            raise

    @classmethod
    def attach(cls, layout: ArenaLayout, fd: int) -> "Arena":
        """Maps an arena created elsewhere (the file descriptor is owned by the caller)."""
        return cls(layout, fd, owner=False)

    def write_error(self, index: int, text: str) -> None:
        """Leaves ``text`` (its tail, if too long) in slot ``index``'s error block."""
        data = text.encode("utf-8", "replace")[-self.error_text.shape[1]:]
        self.error_text[index, : len(data)] = np.frombuffer(data, dtype=np.uint8)
        self.error_len[index] = len(data)

    def read_error(self, index: int) -> str:
        """The error text a worker left in slot ``index`` (empty if none)."""
        return bytes(self.error_text[index, : int(self.error_len[index])]).decode("utf-8", "replace")

    def close(self) -> None:
        """Releases this process's descriptor; the mapping goes away with its last view."""
        if self.fd >= 0:
            if self._owner:
                os.close(self.fd)
            self.fd = -1


def as_key(key) -> Tuple[str, ...]:
    """A TensorDict key as a tuple: ``"obs"`` -> ``("obs",)``."""
    return (key,) if isinstance(key, str) else tuple(key)


def key_repr(key: Tuple[str, ...]):
    """A key tuple as TensorDict spells it: ``("obs",)`` -> ``"obs"``, nested keys stay tuples."""
    return key[0] if len(key) == 1 else key


def layout_repr(fields) -> str:
    """A record's entries as error messages show them: ``'key': (shape) dtype``, comma-separated.

    Args:
        fields (iterable): ``(key, shape, dtype)`` triples; a key is a string or a key tuple,
            a dtype a ``torch.dtype`` or a NumPy one.

    Examples:
        >>> import torch
        >>> from torchrl_asyncpool.exchange.arena import layout_repr
        >>> layout_repr([("observation", (3,), torch.float64), (("agent", "done"), (), torch.bool)])
        "'observation': (3,) float64, ('agent', 'done'): () bool"
    """
    return ", ".join(f"{key_repr(as_key(k))!r}: {tuple(shape)} {str(dtype).replace('torch.', '')}"
                     for k, shape, dtype in fields)


def missing_in_keys(reader, provided) -> list:
    """The ``in_keys`` that ``reader`` declares (a ``TensorDictModule``'s; none for a plain
    callable) and that are not among ``provided`` (key tuples), as TensorDict keys (``"obs"``,
    ``("agent", "obs")``): what to name before a policy fails on records without them.

    Examples:
        >>> from tensordict.nn import TensorDictModule
        >>> from torchrl_asyncpool.exchange.arena import missing_in_keys
        >>> policy = TensorDictModule(lambda x: x, in_keys=["obs", ("agent", "obs")], out_keys=["action"])
        >>> missing_in_keys(policy, {("observation",), ("agent", "obs")})
        ['obs']
        >>> missing_in_keys(lambda td: td, {("observation",)})
        []
    """
    in_keys = getattr(reader, "in_keys", None)
    if in_keys is None:
        return []
    try:
        wanted = [as_key(k) for k in in_keys]
    except TypeError:
        return []
    return [key_repr(k) for k in wanted if k not in provided]



def unread_keys_error(reader, provided, note: str = ""):
    """A ``ValueError`` naming the ``in_keys`` that ``reader`` declares and the records'
    ``provided`` keys (TensorDict keys) lack, with the keys they hold (and ``note`` after
    them); ``None`` when nothing is missing (see :func:`missing_in_keys`).

    Examples:
        >>> from tensordict.nn import TensorDictModule
        >>> from torchrl_asyncpool.exchange.arena import unread_keys_error
        >>> policy = TensorDictModule(lambda x: x, in_keys=["obs"], out_keys=["action"])
        >>> print(unread_keys_error(policy, {"observation", "done"}))
        the policy reads ['obs'], which the env's records do not provide; they hold ['done', 'observation'].
        >>> unread_keys_error(policy, {"obs"}) is None
        True
    """
    missing = missing_in_keys(reader, {as_key(k) for k in provided})
    if not missing:
        return None
    return ValueError(f"the policy reads {missing}, which the env's records do not provide; they hold "
                      f"{sorted(map(str, provided))}{note}.")

def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()
