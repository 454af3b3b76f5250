"""The env-host wire protocol: one bidirectional gRPC stream per remote env, raw bytes only.

An env host (any process, any machine, any language that speaks gRPC) calls the stream
method :data:`METHOD` on the address a pool's :class:`~torchrl_asyncpool.remote.RemoteEnvSlot`
listens on, with the pool's token in the ``x-torchrl-asyncpool-token`` metadata entry. Every
message is a byte string (no protobuf schema, nothing pickled); the server refuses a message
whose length differs from the negotiated layout.

1. **Hello** (host -> server): UTF-8 JSON ``{"protocol": 1, "observation": {key: [shape,
   dtype]}, "action": [shape, dtype]}``, the host env's spec in the pool's terms (what
   :func:`spec_of_spaces` computes from gymnasium spaces: a ``Box``/``Discrete`` observation is
   ``"observation"``, a ``Dict`` one key per entry; a ``Discrete`` value is an ``int64``
   scalar). Dtypes are numpy names (``"float32"``, ``"uint8"``, ...).
2. **Accept** (server -> host): UTF-8 JSON ``{"protocol": 1, "slot": i}``: the host now owns
   slot ``i`` of the pool. A refusal ends the call with a gRPC status instead:
   ``UNAUTHENTICATED`` (token), ``INVALID_ARGUMENT`` (spec differs; the details say how),
   ``RESOURCE_EXHAUSTED`` (every slot is taken).
3. **Records** (host -> server): one byte step type (:class:`~torchrl_asyncpool.StepType`:
   0 FIRST, 1 MID, 2 TERMINATION, 3 TRUNCATION), the reward as a little-endian float64, then
   each observation entry's raw bytes (C order, little-endian, negotiated shape and dtype)
   in the order of the hello's keys. The first record, and every record answering a reset
   command, is FIRST (reward 0); every other record is not.
4. **Commands** (server -> host), one per record: ``b"\\x00"`` followed by the action's raw
   bytes (step with it), or ``b"\\x01"`` (reset: the last record was terminal, or the pool
   wants a new episode; the host resets its env and sends a FIRST record).

The host owns its env and its resets; the pool owns the episode contract: a host that drops
mid-episode ends that episode with a TRUNCATION record (its last observation, reward 0) and
frees the slot for the next host that connects.
"""
from __future__ import annotations

import json
import struct
from typing import Dict, Tuple

import numpy as np

__all__ = [
    "METHOD", "TOKEN_METADATA", "PROTOCOL_VERSION", "spec_of_spaces", "encode_hello", "decode_hello",
    "RecordCodec",
]

#: the gRPC method an env host calls (a bidirectional stream of byte strings)
METHOD = "/torchrl_asyncpool.EnvHost/Stream"
#: the metadata key carrying the pool's token
TOKEN_METADATA = "x-torchrl-asyncpool-token"
PROTOCOL_VERSION = 1
#: command bytes, server -> host
STEP, RESET = 0, 1
#: hello messages larger than this are refused (a spec is a few hundred bytes)
MAX_HELLO_BYTES = 1 << 16

_HEAD = struct.Struct("<Bd")  # step type, reward


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


def encode_hello(spec: dict) -> bytes:
    return json.dumps({"protocol": PROTOCOL_VERSION, **spec}).encode()


def decode_hello(data: bytes) -> dict:
    """Parses a hello; raises ``ValueError`` saying what is wrong with it."""
    if len(data) > MAX_HELLO_BYTES:
        raise ValueError(f"hello of {len(data)} bytes; at most {MAX_HELLO_BYTES} are accepted.")
    try:
        msg = json.loads(data.decode())
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"hello is not UTF-8 JSON: {exc}") from None
    if not isinstance(msg, dict) or msg.get("protocol") != PROTOCOL_VERSION:
        raise ValueError(f"hello must be a JSON object with protocol={PROTOCOL_VERSION}, got {str(msg)[:200]}.")
    if not isinstance(msg.get("observation"), dict) or "action" not in msg:
        raise ValueError("hello must carry 'observation' (an object) and 'action'.")
    return {"observation": msg["observation"], "action": msg["action"]}


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


class RecordCodec:
    """Packs and unpacks records and commands of one negotiated spec (both sides use it)."""

    def __init__(self, spec: dict):
        self.obs = [(k, tuple(shape), np.dtype(dtype).newbyteorder("<")) for k, (shape, dtype) in
                    spec["observation"].items()]
        self.obs_bytes = [int(np.prod(shape, dtype=np.int64)) * dt.itemsize for _, shape, dt in self.obs]
        self.record_bytes = _HEAD.size + sum(self.obs_bytes)
        shape, dtype = spec["action"]
        self.action_shape, self.action_dtype = tuple(shape), np.dtype(dtype).newbyteorder("<")
        self.action_bytes = 1 + int(np.prod(self.action_shape, dtype=np.int64)) * self.action_dtype.itemsize

    # -- records, host -> server ----------------------------------------------------------------
    def pack_record(self, step_type: int, reward: float, obs: Dict) -> bytes:
        parts = [_HEAD.pack(int(step_type), float(reward))]
        for (k, shape, dt), n in zip(self.obs, self.obs_bytes):
            a = np.ascontiguousarray(obs[k], dtype=dt)
            if a.shape != shape:  # a [1] scalar, as envs often return, fits a () entry
                if a.size * dt.itemsize != n:
                    raise ValueError(f"observation {k!r} has shape {a.shape}; the negotiated spec says {shape}.")
                a = a.reshape(shape)
            parts.append(a.tobytes())
        return b"".join(parts)

    def unpack_record(self, data: bytes) -> Tuple[int, float, Dict]:
        """``(step_type, reward, {key: array})``; raises ``ValueError`` on a malformed record."""
        if len(data) != self.record_bytes:
            raise ValueError(f"record of {len(data)} bytes; the negotiated spec makes {self.record_bytes}.")
        st, reward = _HEAD.unpack_from(data)
        if st > 3:
            raise ValueError(f"record with step type {st}; expected 0 (FIRST) .. 3 (TRUNCATION).")
        obs, off = {}, _HEAD.size
        for (k, shape, dt), n in zip(self.obs, self.obs_bytes):
            obs[k] = np.frombuffer(data, dt, count=n // dt.itemsize, offset=off).reshape(shape)
            off += n
        return st, reward, obs

    # -- commands, server -> host ---------------------------------------------------------------
    def pack_action(self, action) -> bytes:
        a = np.ascontiguousarray(action, dtype=self.action_dtype)
        return b"\x00" + a.tobytes()

    def unpack_command(self, data: bytes):
        """``None`` for a reset command, else the action (a numpy array, or an int for a scalar)."""
        if data[:1] == b"\x01" and len(data) == 1:
            return None
        if data[:1] != b"\x00" or len(data) != self.action_bytes:
            raise ValueError(f"malformed command of {len(data)} bytes from the pool.")
        a = np.frombuffer(data, self.action_dtype, offset=1).reshape(self.action_shape)
        return a.item() if a.ndim == 0 and a.dtype.kind in "iu" else a


RESET_COMMAND = b"\x01"


def encode_accept(slot: int) -> bytes:
    return json.dumps({"protocol": PROTOCOL_VERSION, "slot": int(slot)}).encode()
