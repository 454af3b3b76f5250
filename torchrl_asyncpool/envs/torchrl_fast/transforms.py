"""The TorchRL transforms the fast path reproduces on numpy records (``StepCounter``,
``RewardSum``, ``RewardScaling``, ``ObservationNorm``, ``DoubleToFloat``, ``CatTensors``,
``UnsqueezeTransform``): :func:`fast_transform` returns a transform's numpy counterpart, or
raises :class:`~torchrl_asyncpool.envs.torchrl_fast.unsupported.FastPathUnsupported` when its
arithmetic or state would not be TorchRL's. A vector env's records take them row by row
(:func:`check_vector_transform` refuses those that cannot)."""
from __future__ import annotations

import numpy as np
import torch

from torchrl_asyncpool.envs.torchrl_fast.unsupported import FastPathUnsupported, np_dtype

__all__ = ["fast_transform", "check_vector_transform"]


class _Fast:
    """A transform on numpy records: ``reset(rec)`` and ``step(rec, reward, term, trunc)``."""

    #: what the direct step of a single env (``_Plan.direct``) makes of this transform: ``None``
    #: (it cannot: the env takes the record path), ``"cast"`` (the observation's copy into its
    #: row casts it), ``"count"`` (:meth:`_StepCounter.advance`) or ``"sum"`` (:meth:`_RewardSum.add`)
    direct_role = None

    def action(self, action):
        """The action row as the env below this transform takes it (its inverse, if any)."""
        return action

    def reset(self, rec: dict) -> None:
        pass

    def step(self, rec: dict, reward, terminated: bool, truncated: bool):
        return reward, terminated, truncated

    # A vector env's records carry a leading k; ``first`` (bool [k]) marks the rows that are a
    # reset observation (gymnasium's NEXT_STEP autoreset), where an episode's state restarts.
    # Elementwise transforms apply to every row alike; the stateful ones override these.
    def vreset(self, rec: dict, k: int) -> None:
        self.reset(rec)

    def vstep(self, rec: dict, reward, terminated, truncated, first):
        return self.step(rec, reward, terminated, truncated)


def _only_root_reset(t):
    keys = t.parent._filtered_reset_keys if t.parent is not None else ["_reset"]
    if list(keys) != ["_reset"]:
        raise FastPathUnsupported(f"{type(t).__name__} over reset keys {keys}")


def _no_inverse(t):
    if list(getattr(t, "in_keys_inv", None) or []):
        raise FastPathUnsupported(f"{type(t).__name__} with inverse keys {t.in_keys_inv}")


class _StepCounter(_Fast):
    direct_role = "count"

    def __init__(self, t):
        _only_root_reset(t)
        if t.truncated_key != "truncated":
            raise FastPathUnsupported("StepCounter with a truncated_key other than 'truncated'")
        self.key, self.max_steps = t.step_count_key, t.max_steps
        self.n = 0

    def reset(self, rec):
        self.n = 0
        rec[self.key] = np.zeros(1, np.int64)

    def step(self, rec, reward, terminated, truncated):
        rec[self.key] = np.array([self.n + 1], np.int64)
        return reward, terminated, self.advance() or truncated

    def advance(self) -> bool:
        """Counts a step; returns whether it truncates the episode (StepCounter ORs that into
        truncated and done). The count is ``self.n``."""
        self.n += 1
        return self.max_steps is not None and self.n >= self.max_steps

    def vreset(self, rec, k):
        self.n = np.zeros((k, 1), np.int64)
        rec[self.key] = self.n

    def vstep(self, rec, reward, terminated, truncated, first):
        self.n = np.where(first[:, None], 0, self.n + 1)
        rec[self.key] = self.n
        return reward, terminated, truncated


class _RewardSum(_Fast):
    direct_role = "sum"

    def __init__(self, t):
        _only_root_reset(t)
        if t.reward_spec:
            raise FastPathUnsupported("RewardSum(reward_spec=True)")
        if list(t.in_keys) != ["reward"] or len(t.out_keys) != 1 or not isinstance(t.out_keys[0], str):
            raise FastPathUnsupported(f"RewardSum keys {t.in_keys} -> {t.out_keys}")
        self.key = t.out_keys[0]
        self.total = np.float32(0)  # a float32 scalar: numpy adds two in float32, as torch does

    def reset(self, rec):
        self.total = np.float32(0)
        rec[self.key] = np.zeros(1, np.float32)

    def step(self, rec, reward, terminated, truncated):
        total = self.total + reward  # float32 + float32 [1] -> float32 [1], as torch adds them
        rec[self.key] = total
        self.total = total[0]
        return reward, terminated, truncated

    def vreset(self, rec, k):
        self.total = np.zeros((k, 1), np.float32)
        rec[self.key] = self.total

    def vstep(self, rec, reward, terminated, truncated, first):
        self.total = np.where(first[:, None], np.float32(0), self.total + reward)
        rec[self.key] = self.total
        return reward, terminated, truncated


def _affine_params(t, dtype, what):
    loc, scale = t.loc, t.scale
    if not isinstance(loc, torch.Tensor) or not isinstance(scale, torch.Tensor):
        raise FastPathUnsupported(f"{what}: loc/scale not initialised")
    if isinstance(loc, torch.nn.parameter.UninitializedBuffer) or isinstance(scale,
                                                                             torch.nn.parameter.UninitializedBuffer):
        raise FastPathUnsupported(f"{what}: loc/scale not initialised")
    if np_dtype(loc.dtype) != dtype or np_dtype(scale.dtype) != dtype:
        # torch keeps a float32 entry float32 against a float64 0-d loc; numpy would not
        raise FastPathUnsupported(f"{what}: loc/scale dtype {loc.dtype}/{scale.dtype} != entry dtype {dtype}")
    if loc.device.type != "cpu" or scale.device.type != "cpu":
        raise FastPathUnsupported(f"{what}: loc/scale on {loc.device}")
    return loc.detach().numpy().copy(), scale.detach().numpy().copy(), bool(t.standard_normal)


class _RewardScaling(_Fast):
    def __init__(self, t):
        if list(t.in_keys) != ["reward"] or list(t.out_keys) != ["reward"]:
            raise FastPathUnsupported(f"RewardScaling keys {t.in_keys} -> {t.out_keys}")
        self.loc, self.scale, self.standard = _affine_params(t, np.dtype(np.float32), "RewardScaling")
        if np.broadcast_shapes(self.loc.shape, self.scale.shape, (1,)) != (1,):
            raise FastPathUnsupported("RewardScaling loc/scale change the reward's shape")

    def step(self, rec, reward, terminated, truncated):
        if self.standard:
            return (reward - self.loc) / self.scale, terminated, truncated
        return reward * self.scale + self.loc, terminated, truncated


class _ObservationNorm(_Fast):
    def __init__(self, t, dtypes):
        _no_inverse(t)
        self.keys = list(zip(t.in_keys, t.out_keys))
        self.params = {}
        for k, _ in self.keys:
            if k not in dtypes:
                raise FastPathUnsupported(f"ObservationNorm of {k!r}, which is not an observation entry")
            self.params[k] = _affine_params(t, dtypes[k][0], "ObservationNorm")
            loc, scale, _ = self.params[k]
            if np.broadcast_shapes(loc.shape, scale.shape, dtypes[k][1]) != dtypes[k][1]:
                raise FastPathUnsupported("ObservationNorm loc/scale change the entry's shape")

    def _apply(self, rec):
        for k, out in self.keys:
            loc, scale, standard = self.params[k]
            rec[out] = (rec[k] - loc) / scale if standard else rec[k] * scale + loc

    def reset(self, rec):
        self._apply(rec)

    def step(self, rec, reward, terminated, truncated):
        self._apply(rec)
        return reward, terminated, truncated


class _DoubleToFloat(_Fast):
    direct_role = "cast"

    def __init__(self, t, dtypes, action_dtype):
        if t.dtype_in != torch.float64 or t.dtype_out != torch.float32:
            raise FastPathUnsupported("DTypeCastTransform other than float64 -> float32")
        self.keys = list(zip(t.in_keys or [], t.out_keys or []))
        for k, _ in self.keys:
            if k == "reward" or k not in dtypes:
                raise FastPathUnsupported(f"DoubleToFloat of {k!r}, which is not an observation entry")
        inv = list(t.in_keys_inv or [])
        if inv not in ([], ["action"]) or list(t.out_keys_inv or []) != inv:
            raise FastPathUnsupported(f"DoubleToFloat inverse keys {inv}")
        self.cast_action = inv == ["action"] and action_dtype == np.float64

    def action(self, action):
        return action.astype(np.float64) if self.cast_action else action

    def _apply(self, rec):
        for k, out in self.keys:
            rec[out] = np.asarray(rec[k]).astype(np.float32)

    def reset(self, rec):
        self._apply(rec)

    def step(self, rec, reward, terminated, truncated):
        self._apply(rec)
        return reward, terminated, truncated


class _CatTensors(_Fast):
    def __init__(self, t, dtypes):
        ins = list(t.in_keys)
        if not ins or any(k not in dtypes for k in ins):
            raise FastPathUnsupported(f"CatTensors of {ins}, not all observation entries")
        if len({dtypes[k][0] for k in ins}) != 1:
            raise FastPathUnsupported("CatTensors over entries of different dtypes (torch.cat promotes)")
        if any(len(dtypes[k][1]) == 0 for k in ins):
            raise FastPathUnsupported("CatTensors over 0-d entries")
        self.ins, self.out, self.dim = ins, t.out_keys[0], t.dim
        self.drop = list(t.keys_to_exclude) if t._del_keys else []

    def _apply(self, rec):
        rec[self.out] = np.concatenate([rec[k] for k in self.ins], axis=self.dim)
        for k in self.drop:
            rec.pop(k, None)

    def reset(self, rec):
        self._apply(rec)

    def step(self, rec, reward, terminated, truncated):
        self._apply(rec)
        return reward, terminated, truncated


class _Unsqueeze(_Fast):
    def __init__(self, t, dtypes):
        _no_inverse(t)
        self.keys = list(zip(t.in_keys, t.out_keys))
        for k, _ in self.keys:
            if k not in dtypes:
                raise FastPathUnsupported(f"UnsqueezeTransform of {k!r}, which is not an observation entry")
        self.dim = t.dim

    def _apply(self, rec):
        for k, out in self.keys:
            rec[out] = np.expand_dims(rec[k], self.dim)

    def reset(self, rec):
        self._apply(rec)

    def step(self, rec, reward, terminated, truncated):
        self._apply(rec)
        return reward, terminated, truncated


def check_vector_transform(t):
    """Raises :class:`FastPathUnsupported` unless a vector env's records can take the transform
    ``t`` row by row (see ``_Fast.vstep``).

    Args:
        t: a TorchRL transform over ``GymEnv(env_id, num_envs=k)``.
    """
    from torchrl.envs.transforms import CatTensors, StepCounter

    if type(t) is StepCounter and t.max_steps is not None:
        # its truncation would need the vector env to reset that env, which it does not know of
        raise FastPathUnsupported("StepCounter(max_steps=...) over a vector env (pass max_episode_steps to GymEnv)")
    if type(t) is CatTensors and t.dim >= 0:
        raise FastPathUnsupported("CatTensors with a non-negative dim over a vector env")


def fast_transform(t, dtypes, action_dtype):
    """The numpy counterpart of the TorchRL transform ``t``; raises :class:`FastPathUnsupported`
    for a transform (or arguments) whose records it would not reproduce exactly.

    Args:
        t: a TorchRL transform (not a ``Compose``).
        dtypes (dict): ``{entry: (np dtype, shape)}`` of the record ``t`` sees.
        action_dtype (np.dtype): the base env's action dtype.
    """
    from torchrl.envs.transforms import (CatTensors, DoubleToFloat, ObservationNorm, RewardScaling, RewardSum,
                                         StepCounter, UnsqueezeTransform)

    kind = type(t)
    if kind is StepCounter:
        return _StepCounter(t)
    if kind is RewardSum:
        return _RewardSum(t)
    if kind is RewardScaling:
        return _RewardScaling(t)
    if kind is ObservationNorm:
        return _ObservationNorm(t, dtypes)
    if kind is DoubleToFloat:
        return _DoubleToFloat(t, dtypes, action_dtype)
    if kind is CatTensors:
        return _CatTensors(t, dtypes)
    if kind is UnsqueezeTransform:
        return _Unsqueeze(t, dtypes)
    raise FastPathUnsupported(f"transform {kind.__name__}")
