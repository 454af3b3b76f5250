"""The env-host wire protocol: one bidirectional gRPC stream per remote env.

The messages are those of ``env_host.proto`` (shipped next to this module: generate a client in
any language with ``protoc``). This module encodes and decodes them by hand, with nothing but
the protobuf wire format, so the package needs no protobuf runtime and never unpickles anything:
a message is a few tagged fields around raw tensor bytes, checked against the negotiated layout.

1. **Hello** (host -> pool, ``HostMessage.hello_json``): UTF-8 JSON ``{"protocol": 1,
   "observation": {key: [shape, dtype]}, "action": [shape, dtype]}``, the host env's spec in
   the pool's terms (what :func:`spec_of_spaces` computes from gymnasium spaces: a
   ``Box``/``Discrete`` observation is ``"observation"``, a ``Dict`` one key per entry; a
   ``Discrete`` value is an ``int64`` scalar). Dtypes are numpy names (``"float32"``, ...).
   The pool's token goes in the ``x-torchrl-asyncpool-token`` metadata entry of the call.
2. **Accept** (pool -> host, ``PoolMessage.accept_json``): ``{"protocol": 1, "slot": i}``: the
   host now owns slot ``i``. A refusal ends the call with a gRPC status instead:
   ``UNAUTHENTICATED`` (token), ``INVALID_ARGUMENT`` (spec differs; the details say how),
   ``RESOURCE_EXHAUSTED`` (every slot is taken).
3. **Records** (host -> pool, ``HostMessage.record``): the step type
   (:class:`~torchrl_asyncpool.StepType`: 0 FIRST, 1 MID, 2 TERMINATION, 3 TRUNCATION), the
   reward (double) and one ``bytes`` entry per observation key in the hello's order (raw
   little-endian bytes, C order, the negotiated shape and dtype). The first record, and every
   record answering a reset, is FIRST (reward 0); every other record is not.
4. **Commands** (pool -> host), one per record: ``PoolMessage.action`` (the action's raw
   bytes: step with it) or ``PoolMessage.reset`` (the last record was terminal: reset the env
   and send a FIRST record).

The host owns its env and its resets; the pool owns the episode contract: a host that drops
mid-episode ends that episode with a TRUNCATION record (its last observation, reward 0) and
frees the slot for the next host that connects.
"""
from __future__ import annotations

import json
import math
import struct
from typing import Dict, Tuple

import numpy as np

__all__ = [
    "METHOD", "TOKEN_METADATA", "PROTOCOL_VERSION", "PROTO_FILE", "spec_of_spaces", "spec_difference",
    "encode_hello", "decode_hello", "encode_accept", "decode_accept", "RecordCodec", "BatchCodec", "import_grpc",
    "BATCHED_PROTOCOL", "MAX_BATCH_ENVS",
]

#: the gRPC method an env host calls (``service EnvHost { rpc Stream }`` of ``env_host.proto``)
METHOD = "/torchrl_asyncpool.EnvHost/Stream"
#: the metadata key carrying the pool's token
TOKEN_METADATA = "x-torchrl-asyncpool-token"
#: the protocol version a hello and an accept carry for one env per stream
PROTOCOL_VERSION = 1
#: the protocol version of a host serving ``num_envs`` envs over one stream (batched records and
#: commands); a hello with a version other than these two is refused
BATCHED_PROTOCOL = 2
#: the most envs one protocol-2 host may declare
MAX_BATCH_ENVS = 1 << 16
#: the protocol's .proto file, shipped with the package
PROTO_FILE = __file__.rsplit("/", 1)[0] + "/env_host.proto"
#: hello messages larger than this are refused (a spec is a few hundred bytes)
MAX_HELLO_BYTES = 1 << 16

# field numbers of env_host.proto
_HELLO, _RECORD, _RECORDS = 1, 2, 3  # HostMessage
_STEP_TYPE, _REWARD, _OBS = 1, 2, 3  # Record
_B_ENV, _B_STEP_TYPE, _B_REWARD, _B_OBS = 1, 2, 3, 4  # RecordBatch
_ACCEPT, _ACTION, _RESET, _COMMANDS = 1, 2, 3, 4  # PoolMessage
_C_ENV, _C_RESET, _C_ACTION = 1, 2, 3  # CommandBatch
_VARINT, _I64, _LEN, _I32 = 0, 1, 2, 5  # wire types
_DOUBLE = struct.Struct("<d")


# -- protobuf wire format (just what env_host.proto uses) ---------------------------------------
def _varint(n: int) -> bytes:
    out = bytearray()
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _tag(field: int, wire: int) -> bytes:
    return _varint(field << 3 | wire)


def _len_field(field: int, data) -> bytes:
    return _tag(field, _LEN) + _varint(len(data)) + bytes(data)


def _read_varint(buf, pos: int) -> Tuple[int, int]:
    value = shift = 0
    while True:
        if pos >= len(buf) or shift > 63:
            raise ValueError("truncated or oversized varint")
        b = buf[pos]
        pos += 1
        value |= (b & 0x7F) << shift
        if b < 0x80:
            return value, pos
        shift += 7


def _fields(buf):
    """Yields ``(field number, wire type, value)`` of a message: an int for varints, a
    memoryview for fixed64 and length-delimited fields; fixed32 fields are skipped."""
    buf = memoryview(buf)
    pos, end = 0, len(buf)
    while pos < end:
        key, pos = _read_varint(buf, pos)
        field, wire = key >> 3, key & 7
        if wire == _VARINT:
            value, pos = _read_varint(buf, pos)
        elif wire == _I64:
            value, pos = buf[pos:pos + 8], pos + 8
        elif wire == _LEN:
            n, pos = _read_varint(buf, pos)
            value, pos = buf[pos:pos + n], pos + n
        elif wire == _I32:
            pos += 4
            continue
        else:
            raise ValueError(f"unsupported protobuf wire type {wire}")
        if pos > end:
            raise ValueError("truncated message")
        yield field, wire, value


def _one_of(data, what: str, names: dict):
    """The single set field of a ``oneof`` message: ``(field, wire, value)``."""
    found = None
    for field, wire, value in _fields(data):
        if field in names:
            found = (field, wire, value)  # protobuf: the last one wins
    if found is None:
        raise ValueError(f"{what} carries none of {sorted(names.values())}")
    return found


def window_options(max_message_bytes: int) -> list:
    """gRPC channel/server options that let a stream carry a whole message of up to
    ``max_message_bytes`` without waiting for HTTP/2 flow-control updates (the default window
    is 64 KB: a 340 KB batch of pixel records would otherwise cross a few round trips)."""
    return [("grpc.http2.lookahead_bytes", int(min(64 << 20, max(64 << 10, 2 * max_message_bytes))))]


def import_grpc():
    """``grpc``, or an ImportError that says how to install it (an optional dependency)."""
    try:
        import grpc
    except ImportError:
        raise ImportError(
            "remote env hosts need grpcio: pip install 'torchrl-asyncpool[remote]' (or pip install grpcio)."
        ) from None
    return grpc


# -- spec ---------------------------------------------------------------------------------------
def spec_of_spaces(observation_space, action_space) -> dict:
    """The wire spec ``{"observation": {key: [shape, dtype]}, "action": [shape, dtype]}`` of a
    gymnasium env's spaces, as the pool lays them out (see the module docstring).

    Examples:
        >>> import gymnasium as gym
        >>> env = gym.make("CartPole-v1")
        >>> spec_of_spaces(env.observation_space, env.action_space)
        {'observation': {'observation': [[4], 'float32']}, 'action': [[], 'int64']}
    """
    import gymnasium as gym

    def one(space, what):
        if isinstance(space, gym.spaces.Discrete):
            return [[], "int64"]
        if isinstance(space, (gym.spaces.Box, gym.spaces.MultiDiscrete, gym.spaces.MultiBinary)):
            return [list(space.shape), np.dtype(space.dtype).name]
        raise TypeError(f"unsupported gymnasium {what} space {space!r} for a remote env.")

    if isinstance(observation_space, gym.spaces.Dict):
        obs = {k: one(s, "observation") for k, s in observation_space.spaces.items()}
    else:
        obs = {"observation": one(observation_space, "observation")}
    return {"observation": obs, "action": one(action_space, "action")}


def spec_difference(expected: dict, got: dict) -> str | None:
    """``None`` when the specs match, else one line saying where they differ."""
    exp_obs, got_obs = expected["observation"], got["observation"]
    if list(exp_obs) != list(got_obs):
        return f"observation keys {list(got_obs)}, the pool expects {list(exp_obs)}"
    for k in exp_obs:
        if list(got_obs[k]) != list(exp_obs[k]):
            return f"observation {k!r} is {got_obs[k]}, the pool expects {exp_obs[k]} ([shape, dtype])"
    if list(got["action"]) != list(expected["action"]):
        return f"action is {got['action']}, the pool expects {expected['action']} ([shape, dtype])"
    return None


def _check_entry(what, entry) -> None:
    ok = (isinstance(entry, list) and len(entry) == 2 and isinstance(entry[0], list)
          and all(isinstance(d, int) and not isinstance(d, bool) and 0 <= d < 1 << 31 for d in entry[0])
          and isinstance(entry[1], str))
    if ok:
        try:
            np.dtype(entry[1])
        except (TypeError, ValueError):  # ValueError: e.g. a subarray dtype too large, "(1000000000000000,)f8"
            ok = False
    if not ok:
        raise ValueError(f"{what} must be [shape (list of ints), numpy dtype name], got {str(entry)[:100]}.")


# -- hello / accept -----------------------------------------------------------------------------
def encode_hello(spec: dict, num_envs: int | None = None) -> bytes:
    """A host's first message (``HostMessage.hello_json``): ``spec`` as JSON, with the
    :data:`PROTOCOL_VERSION` (one env), or :data:`BATCHED_PROTOCOL` and ``num_envs`` (a host of
    ``num_envs`` envs over one stream); :func:`decode_hello` parses it.

    Args:
        spec (dict): ``{"observation": {key: [shape, dtype]}, "action": [shape, dtype]}``, as
            :func:`spec_of_spaces` returns (the spec of one env).
        num_envs (int, optional): the envs a protocol-2 host serves. Defaults to ``None``
            (protocol 1).

    Examples:
        >>> from torchrl_asyncpool.remote.protocol import decode_hello, encode_hello
        >>> spec = {"observation": {"observation": [[4], "float32"]}, "action": [[], "int64"]}
        >>> decode_hello(encode_hello(spec)) == spec
        True
    """
    if num_envs is None:
        return _len_field(_HELLO, json.dumps({"protocol": PROTOCOL_VERSION, **spec}).encode())
    return _len_field(_HELLO, json.dumps({"protocol": BATCHED_PROTOCOL, "num_envs": int(num_envs), **spec}).encode())


def decode_hello(data: bytes) -> dict:
    """Parses a hello: the spec, with ``"num_envs"`` added for a protocol-2 hello; raises
    ``ValueError`` saying what is wrong with it."""
    if len(data) > MAX_HELLO_BYTES:
        raise ValueError(f"hello of {len(data)} bytes; at most {MAX_HELLO_BYTES} are accepted.")
    field, wire, value = _one_of(data, "the first message", {_HELLO: "hello_json", _RECORD: "record"})
    if field != _HELLO or wire != _LEN:
        raise ValueError("the first message must be a hello (HostMessage.hello_json), not a record.")
    try:
        msg = json.loads(bytes(value).decode())
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"hello is not UTF-8 JSON: {exc}") from None
    except RecursionError:  # "[[[[...]]]]" within the size limit: the host must hear why, not a silent end
        raise ValueError("hello is JSON nested too deeply (a spec is an object of [shape, dtype] lists).") from None
    if not isinstance(msg, dict) or msg.get("protocol") not in (PROTOCOL_VERSION, BATCHED_PROTOCOL):
        raise ValueError(f"hello must be a JSON object with protocol={PROTOCOL_VERSION} (one env) or "
                         f"{BATCHED_PROTOCOL} (num_envs envs), got {str(msg)[:200]}.")
    obs = msg.get("observation")
    if not isinstance(obs, dict) or not obs or "action" not in msg:
        raise ValueError("hello must carry 'observation' (a non-empty object) and 'action'.")
    for k, entry in obs.items():
        _check_entry(f"observation {k!r}", entry)
    _check_entry("action", msg["action"])
    if msg["protocol"] == PROTOCOL_VERSION:
        return {"observation": obs, "action": msg["action"]}
    k = msg.get("num_envs")
    if not isinstance(k, int) or isinstance(k, bool) or not 0 < k <= MAX_BATCH_ENVS:
        raise ValueError(f"a protocol-{BATCHED_PROTOCOL} hello must carry num_envs, an int in 1..{MAX_BATCH_ENVS}, "
                         f"got {str(k)[:50]}.")
    return {"observation": obs, "action": msg["action"], "num_envs": k}


def encode_accept(slot: int, num_envs: int | None = None) -> bytes:
    """The pool's first message to a host (``PoolMessage.accept_json``): the index of the slot
    it fills, with the :data:`PROTOCOL_VERSION`; for a protocol-2 host (``num_envs`` given), the
    index of its first env among the vector slot's envs (its block), with :data:`BATCHED_PROTOCOL`.
    :func:`decode_accept` parses it.

    Examples:
        >>> from torchrl_asyncpool.remote.protocol import decode_accept, encode_accept
        >>> decode_accept(encode_accept(3))
        3
    """
    if num_envs is None:
        return _len_field(_ACCEPT, json.dumps({"protocol": PROTOCOL_VERSION, "slot": int(slot)}).encode())
    return _len_field(_ACCEPT, json.dumps({"protocol": BATCHED_PROTOCOL, "slot": int(slot),
                                           "num_envs": int(num_envs)}).encode())


def decode_accept(data: bytes) -> int:
    """The slot index of an accept message."""
    field, wire, value = _one_of(data, "the pool's first message", {_ACCEPT: "accept_json", _ACTION: "action",
                                                                    _RESET: "reset"})
    if field != _ACCEPT or wire != _LEN:
        raise ValueError("the pool's first message is not an accept (PoolMessage.accept_json).")
    return int(json.loads(bytes(value).decode())["slot"])


# -- records and commands -----------------------------------------------------------------------
class RecordCodec:
    """Packs and unpacks records and commands of one negotiated spec (both sides use it)."""

    def __init__(self, spec: dict):
        self.obs = [(k, tuple(shape), np.dtype(dtype).newbyteorder("<")) for k, (shape, dtype) in
                    spec["observation"].items()]
        self.obs_bytes = [int(np.prod(shape, dtype=np.int64)) * dt.itemsize for _, shape, dt in self.obs]
        self.action_shape = tuple(spec["action"][0])
        self.action_dtype = np.dtype(spec["action"][1]).newbyteorder("<")
        self.action_bytes = int(np.prod(self.action_shape, dtype=np.int64)) * self.action_dtype.itemsize
        #: the largest message either side sends (for gRPC's message size limits)
        self.max_message_bytes = 64 + sum(n + 16 for n in self.obs_bytes) + self.action_bytes

    # -- records, host -> pool ------------------------------------------------------------------
    def pack_record(self, step_type: int, reward: float, obs: Dict) -> bytes:
        """A ``HostMessage.record`` with the raw bytes of every negotiated observation key; raises
        ``ValueError`` when an observation does not fit its negotiated shape."""
        parts = [_tag(_STEP_TYPE, _VARINT), _varint(int(step_type)), _tag(_REWARD, _I64), _DOUBLE.pack(reward)]
        obs_tag = _tag(_OBS, _LEN)
        for (k, shape, dt), n in zip(self.obs, self.obs_bytes):
            a = np.ascontiguousarray(obs[k], dtype=dt)
            if a.shape != shape:  # a [1] scalar, as envs often return, fits a () entry
                if a.size * dt.itemsize != n:
                    raise ValueError(f"observation {k!r} has shape {a.shape}; the negotiated spec says {shape}.")
                a = a.reshape(shape)
            parts += [obs_tag, _varint(n), a.tobytes()]
        record = b"".join(parts)
        return _tag(_RECORD, _LEN) + _varint(len(record)) + record

    def unpack_record(self, data: bytes) -> Tuple[int, float, Dict]:
        """``(step_type, reward, {key: array})``; raises ``ValueError`` on a malformed record."""
        field, wire, record = _one_of(data, "a host message", {_HELLO: "hello_json", _RECORD: "record"})
        if field != _RECORD or wire != _LEN:
            raise ValueError("expected a record (HostMessage.record), got another hello.")
        st, reward, entries = 0, 0.0, []
        for field, wire, value in _fields(record):
            if field == _STEP_TYPE and wire == _VARINT:
                st = value
            elif field == _REWARD and wire == _I64:
                reward = _DOUBLE.unpack(value)[0]
            elif field == _OBS and wire == _LEN:
                entries.append(value)
        if st > 3:
            raise ValueError(f"record with step type {st}; expected 0 (FIRST) .. 3 (TRUNCATION).")
        if not math.isfinite(reward):
            raise ValueError(f"record with reward {reward!r}; rewards must be finite numbers.")
        if len(entries) != len(self.obs):
            raise ValueError(f"record with {len(entries)} observation entries; the negotiated spec has "
                             f"{len(self.obs)} ({[k for k, _, _ in self.obs]}).")
        obs = {}
        for (k, shape, dt), n, value in zip(self.obs, self.obs_bytes, entries):
            if len(value) != n:
                raise ValueError(f"observation {k!r} of {len(value)} bytes; the negotiated {shape} {dt.name} "
                                 f"makes {n}.")
            obs[k] = np.frombuffer(value, dt).reshape(shape)
        return st, reward, obs

    # -- commands, pool -> host -----------------------------------------------------------------
    def pack_action(self, action) -> bytes:
        """A ``PoolMessage.action`` with the raw bytes of ``action`` in the negotiated dtype."""
        a = np.ascontiguousarray(action, dtype=self.action_dtype)
        return _len_field(_ACTION, a.tobytes())

    def unpack_command(self, data: bytes):
        """``None`` for a reset command, else the action (a numpy array, or an int for a
        scalar integer action)."""
        field, wire, value = _one_of(data, "a pool message", {_ACCEPT: "accept_json", _ACTION: "action",
                                                              _RESET: "reset"})
        if field == _RESET and wire == _VARINT and value:
            return None
        if field != _ACTION or wire != _LEN or len(value) != self.action_bytes:
            raise ValueError(f"malformed command from the pool (field {field}, {len(value)} bytes).")
        a = np.frombuffer(value, self.action_dtype).reshape(self.action_shape)
        return a.item() if a.ndim == 0 and a.dtype.kind in "iu" else a.copy()


RESET_COMMAND = _tag(_RESET, _VARINT) + _varint(1)


# -- protocol 2: batches of records and commands ------------------------------------------------
_U32 = np.dtype("<u4")
_F64 = np.dtype("<f8")


def _packed(field: int, array: np.ndarray) -> bytes:
    data = array.tobytes()
    return _tag(field, _LEN) + _varint(len(data)) + data


class BatchCodec:
    """Packs and unpacks the batched messages of protocol 2 (``RecordBatch`` from a host of
    ``num_envs`` envs, ``CommandBatch`` from the pool) for one negotiated per-env spec.

    A batch of ``n`` records is a few fields whatever ``n``: the env-local indices (packed
    ``fixed32``), one step-type byte each, the rewards (packed ``double``) and, per observation
    key, the ``n`` observations' raw bytes back to back. Decoding makes numpy views of the
    message's bytes (``[n, *shape]`` per key), no Python object per record.

    Args:
        spec (dict): the per-env spec (:func:`spec_of_spaces`).
        num_envs (int): the envs of the host.
    """

    def __init__(self, spec: dict, num_envs: int):
        self.one = RecordCodec(spec)
        self.num_envs = int(num_envs)
        self.obs = self.one.obs
        self.obs_bytes = self.one.obs_bytes
        #: the largest message either side sends (for gRPC's message size limits)
        self.max_message_bytes = 64 + self.num_envs * (self.one.max_message_bytes + 16)

    # -- records, host -> pool ------------------------------------------------------------------
    def pack_records(self, envs, step_types, rewards, obs: Dict) -> bytes:
        """A ``HostMessage.records``: ``envs`` (env-local indices), their ``step_types`` and
        ``rewards`` (one each) and ``obs`` (``{key: [n, *shape] array}``, or a ``[n, *shape]``
        array for the single key ``"observation"``)."""
        envs = np.ascontiguousarray(envs, _U32).reshape(-1)
        n = len(envs)
        parts = [_packed(_B_ENV, envs),
                 _len_field(_B_STEP_TYPE, np.ascontiguousarray(step_types, np.uint8).reshape(n).tobytes()),
                 _packed(_B_REWARD, np.ascontiguousarray(rewards, _F64).reshape(n))]
        if not isinstance(obs, dict):
            obs = {"observation": obs}
        obs_tag = _tag(_B_OBS, _LEN)
        for (k, shape, dt), nbytes in zip(self.obs, self.obs_bytes):
            a = np.ascontiguousarray(obs[k], dtype=dt)
            if a.size * dt.itemsize != n * nbytes:
                raise ValueError(f"observation {k!r} has shape {a.shape}; {n} records of the negotiated {shape} "
                                 "were expected.")
            parts += [obs_tag, _varint(n * nbytes), memoryview(a.reshape(-1)).cast("B")]
        # one copy of the observations: straight from the arrays into the message
        size = sum(len(p) for p in parts)
        return b"".join([_tag(_RECORDS, _LEN), _varint(size), *parts])

    def unpack_records(self, data: bytes):
        """``(envs, step_types, rewards, {key: [n, *shape] array})`` of a ``HostMessage.records``
        (numpy views of ``data``: int64 env indices, uint8 step types, float64 rewards); raises
        ``ValueError`` on a malformed batch (sizes that disagree, an env index out of range, a
        step type above 3)."""
        field, wire, batch = _one_of(data, "a host message", {_HELLO: "hello_json", _RECORD: "record",
                                                             _RECORDS: "records"})
        if field != _RECORDS or wire != _LEN:
            raise ValueError("a protocol-2 host sends record batches (HostMessage.records), got "
                             f"{'a hello' if field == _HELLO else 'a single record'}.")
        envs = sts = rewards = None
        entries = []
        for field, wire, value in _fields(batch):
            if wire != _LEN:
                continue
            if field == _B_ENV:
                envs = value
            elif field == _B_STEP_TYPE:
                sts = value
            elif field == _B_REWARD:
                rewards = value
            elif field == _B_OBS:
                entries.append(value)
        if envs is None or len(envs) % 4:
            raise ValueError("a record batch needs its env indices (packed fixed32).")
        envs = np.frombuffer(envs, _U32)
        n = len(envs)
        if n == 0 or n > self.num_envs:
            raise ValueError(f"a record batch of {n} records; a host of {self.num_envs} envs sends 1..{self.num_envs}.")
        if sts is None or len(sts) != n or rewards is None or len(rewards) != 8 * n:
            raise ValueError(f"a record batch of {n} env indices needs {n} step-type bytes and {n} rewards (packed "
                             f"double); got {0 if sts is None else len(sts)} and "
                             f"{0 if rewards is None else len(rewards) / 8:g}.")
        sts = np.frombuffer(sts, np.uint8)
        if int(envs.max()) >= self.num_envs:
            raise ValueError(f"record for env {int(envs.max())}; the host declared {self.num_envs} envs.")
        if int(sts.max()) > 3:
            raise ValueError(f"record with step type {int(sts.max())}; expected 0 (FIRST) .. 3 (TRUNCATION).")
        bad = np.flatnonzero(~np.isfinite(np.frombuffer(rewards, _F64)))
        if bad.size:
            env, value = int(envs[bad[0]]), float(np.frombuffer(rewards, _F64)[bad[0]])
            raise ValueError(f"record for env {env} with reward {value!r}; rewards must be finite numbers.")
        if len(entries) != len(self.obs):
            raise ValueError(f"record batch with {len(entries)} observation entries; the negotiated spec has "
                             f"{len(self.obs)} ({[k for k, _, _ in self.obs]}).")
        obs = {}
        for (k, shape, dt), nbytes, value in zip(self.obs, self.obs_bytes, entries):
            if len(value) != n * nbytes:
                raise ValueError(f"observation {k!r}: {len(value)} bytes for {n} records of the negotiated {shape} "
                                 f"{dt.name} ({nbytes} bytes each).")
            obs[k] = np.frombuffer(value, dt).reshape((n, *shape))
        return envs.astype(np.int64), sts, np.frombuffer(rewards, _F64), obs

    # -- commands, pool -> host -----------------------------------------------------------------
    def pack_commands(self, envs, resets, actions) -> bytes:
        """A ``PoolMessage.commands``: for each of ``envs``, reset it (``resets`` true) or step
        it with its row of ``actions`` (``[n, *action shape]``; a reset's row is sent but
        ignored)."""
        envs = np.ascontiguousarray(envs, _U32).reshape(-1)
        n = len(envs)
        a = np.ascontiguousarray(actions, dtype=self.one.action_dtype)
        if a.size * a.itemsize != n * self.one.action_bytes:
            raise ValueError(f"actions of shape {a.shape} for {n} commands of the negotiated action "
                             f"{self.one.action_shape}.")
        batch = b"".join([_packed(_C_ENV, envs),
                          _len_field(_C_RESET, np.ascontiguousarray(resets, np.uint8).reshape(n).tobytes()),
                          _len_field(_C_ACTION, a.tobytes())])
        return _tag(_COMMANDS, _LEN) + _varint(len(batch)) + batch

    def unpack_commands(self, data: bytes):
        """``(envs, resets, actions)`` of a ``PoolMessage.commands``: int64 env indices, a bool
        mask of the reset commands, the actions ``[n, *action shape]`` (a copy)."""
        field, wire, batch = _one_of(data, "a pool message", {_ACCEPT: "accept_json", _ACTION: "action",
                                                              _RESET: "reset", _COMMANDS: "commands"})
        if field != _COMMANDS or wire != _LEN:
            raise ValueError(f"malformed command batch from the pool (field {field}).")
        envs = resets = actions = None
        for field, wire, value in _fields(batch):
            if wire == _LEN and field == _C_ENV:
                envs = value
            elif wire == _LEN and field == _C_RESET:
                resets = value
            elif wire == _LEN and field == _C_ACTION:
                actions = value
        envs = np.frombuffer(envs if envs is not None else b"", _U32)
        n = len(envs)
        if resets is None or len(resets) != n or actions is None or len(actions) != n * self.one.action_bytes:
            raise ValueError(f"malformed command batch from the pool ({n} envs).")
        if n and int(envs.max()) >= self.num_envs:
            raise ValueError(f"command for env {int(envs.max())} of a host of {self.num_envs} envs.")
        a = np.frombuffer(actions, self.one.action_dtype).reshape((n, *self.one.action_shape)).copy()
        return envs.astype(np.int64), np.frombuffer(resets, np.uint8).astype(bool), a
