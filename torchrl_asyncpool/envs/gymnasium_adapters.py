"""Adapters for gymnasium envs: one env (:class:`GymnasiumEnvAdapter`) or a vector env hosted in
several slots (:class:`GymnasiumVectorAdapter`). A plain gymnasium env skips all TensorDict work
per step."""
from __future__ import annotations

from typing import Dict, Tuple

import numpy as np
import torch

from torchrl_asyncpool.envs.env_attrs import (
    FIRST_SEED_ATTR, RESERVED_KEYS, env_where, own_attr, plan_of, torch_dtype,
)
from torchrl_asyncpool.envs.specs import gymnasium_specs
from torchrl_asyncpool.exchange.native import copy_into

__all__ = ["GymnasiumEnvAdapter", "GymnasiumVectorAdapter"]


class GymnasiumEnvAdapter:
    """Runs a plain :class:`gymnasium.Env` in one slot with no TensorDict work per step.

    Spaces map to keys as TorchRL's ``GymEnv`` does: a ``Box``/``Discrete`` observation is
    ``"observation"``, a ``Dict`` space gives one key per entry; the action is ``"action"``
    (``int64`` scalar for ``Discrete``, the ``Box`` shape and dtype otherwise); the reward is
    ``float32 [1]``. ``env.step`` receives what gymnasium's vector envs hand their sub-envs: a
    numpy integer scalar of the space's dtype for ``Discrete``, a fresh array for ``Box``.
    """

    path = "gymnasium"

    def __init__(self, env, env_index: int | None = None):
        self.env = env
        self._read_spaces(env.observation_space, env.action_space, env_where(env_index))
        self._first_seed = own_attr(env, FIRST_SEED_ATTR)
        self._plan = plan_of(env)
        if self._plan is not None:  # the plain step stays free of the plan's bookkeeping
            self.step = self._planned_step

    def _read_spaces(self, space, a, where: str) -> None:
        import gymnasium as gym

        if isinstance(space, gym.spaces.Dict):
            self._obs_spaces = dict(space.spaces)
            self._dict_obs = True
        elif isinstance(space, (gym.spaces.Box, gym.spaces.Discrete, gym.spaces.MultiDiscrete, gym.spaces.MultiBinary)):
            self._obs_spaces = {"observation": space}
            self._dict_obs = False
        else:
            raise TypeError(f"{where}: unsupported gymnasium observation space {space!r}.")
        for k in self._obs_spaces:
            if k in RESERVED_KEYS:
                raise ValueError(f"{where}: observation key {k!r} collides with a reserved key {RESERVED_KEYS}.")
        self.obs_keys = list(self._obs_spaces)
        if isinstance(a, gym.spaces.Discrete):
            self._action = ((), torch.int64)
            self._discrete = True
            # A numpy scalar of the space's dtype, as gymnasium's vector envs and
            # ``Discrete.sample()`` hand out (TorchRL's GymEnv passes an int; a TorchRL env in
            # a pool still goes through its own ``_step``):
            # ``Discrete.contains``, asserted by most envs' step, checks one ~1.3 us faster than
            # a Python int, ~8 % of a CartPole step.
            self._discrete_scalar = None if a.dtype == np.int64 else a.dtype.type
        elif isinstance(a, (gym.spaces.Box, gym.spaces.MultiDiscrete, gym.spaces.MultiBinary)):
            self._action = (tuple(a.shape), torch_dtype(a.dtype))
            self._discrete = False
        else:
            raise TypeError(f"{where}: unsupported gymnasium action space {a!r}.")
        self.action_keys = ["action"]
        self._action_space = a

    #: the worker hands :meth:`step` numpy views of the action rows (no torch call per step)
    takes_numpy = True

    def fields(self) -> Tuple[Dict, Dict]:
        """``(request, response)`` field specs ``{key: (shape, dtype)}`` for one slot."""
        import gymnasium as gym

        request = {}
        for k, sp in self._obs_spaces.items():
            if isinstance(sp, gym.spaces.Discrete):
                request[k] = ((), torch.int64)
            else:
                request[k] = (tuple(sp.shape), torch_dtype(sp.dtype))
        request["reward"] = ((1,), torch.float32)
        request["step_type"] = ((), torch.int8)
        for k in ("done", "terminated", "truncated"):
            request[k] = ((1,), torch.bool)
        return request, {"action": self._action}

    def specs(self) -> Dict:
        """The slot's TorchRL specs, as ``GymEnv`` converts the spaces (see
        :mod:`~torchrl_asyncpool.envs.specs`)."""
        return gymnasium_specs(self._obs_spaces, self._action_space, self.fields())

    @staticmethod
    def as_numpy(value):
        """Observation entries as they are (gymnasium returns numpy arrays already)."""
        return value

    def random_action(self) -> Dict:
        """A random ``{"action": tensor}`` sampled from the action space."""
        return {"action": torch.as_tensor(self.env.action_space.sample())}

    def _obs(self, obs):
        return obs if self._dict_obs else {"observation": obs}

    def reset(self):
        """Resets the env (with the episode plan's seed and options, or the first seed, when
        set); returns a mapping ``key -> numpy array`` holding the observation."""
        if self._plan is not None:
            seed, options = self._plan.next_reset()
            obs, _ = _reset_result(self.env.reset(seed=seed, options=options))
        elif self._first_seed is not None:
            obs, _ = _reset_result(self.env.reset(seed=self._first_seed))
            self._first_seed = None
        else:  # no seed argument at all: some envs' reset() does not take one
            obs, _ = _reset_result(self.env.reset())
        return self._obs(obs)

    def _planned_step(self, actions: Dict):
        obs, reward, terminated, truncated = GymnasiumEnvAdapter.step(self, actions)
        if self._plan.cut(truncated) and not terminated:
            truncated = True
        return obs, reward, terminated, truncated

    def _action_value(self, actions: Dict):
        """What ``env.step`` gets for the action row ``actions["action"]`` (numpy, or a tensor):
        a copy of a ``Box`` row, or a numpy integer scalar of the ``Discrete`` space's dtype."""
        a = actions["action"]
        if isinstance(a, torch.Tensor):
            a = a.numpy()
        if not self._discrete:
            return a.copy()
        return a[()] if self._discrete_scalar is None else self._discrete_scalar(a)

    def step(self, actions: Dict):
        """Steps with ``actions["action"]``; returns ``(obs, reward, terminated, truncated)``."""
        obs, reward, terminated, truncated, _ = _step_result(self.env.step(self._action_value(actions)))
        return self._obs(obs), reward, bool(terminated), bool(truncated)

    def step_into(self, actions: Dict, views):
        """:meth:`step` that writes the observation into ``views`` (the slot's
        ``[(key, numpy row)]``) and returns ``(reward, terminated, truncated)``: the worker's
        per-step path, with no dict built and no lookup per step."""
        if self._plan is not None:
            obs, reward, terminated, truncated = self._planned_step(actions)
            for key, view in views:
                copy_into(view, obs[key], key)
            return reward, terminated, truncated
        obs, reward, terminated, truncated, _ = _step_result(self.env.step(self._action_value(actions)))
        if self._dict_obs:
            for key, view in views:
                copy_into(view, obs[key], key)
        else:
            copy_into(views[0][1], obs)
        return reward, bool(terminated), bool(truncated)

    def close(self) -> None:
        """Closes the env; an error while closing is swallowed (it must not mask the real one)."""
        try:
            self.env.close()
        except Exception:  # noqa: BLE001 - closing a half-broken env must not mask the real error
            pass


class GymnasiumVectorAdapter(GymnasiumEnvAdapter):
    """Runs a :class:`gymnasium.vector.VectorEnv` of ``k`` envs in ``k`` consecutive slots, in lockstep.

    The slot fields are :class:`GymnasiumEnvAdapter`'s for the vector env's
    ``single_observation_space`` and ``single_action_space``. :meth:`reset` and :meth:`step`
    work on all ``k`` envs at once (observations ``[k, ...]``; rewards, terminated and
    truncated ``[k]``), so a natively vectorized simulator is stepped with one call per pass.
    The vector env must autoreset in gymnasium's ``NEXT_STEP`` mode (its default), which is
    the pool's episode contract: the step after an env ended ignores that env's action and
    returns its reset observation, published as a ``FIRST`` record.

    A vector env whose ``metadata["partial_steps"]`` is true answers each env when its record
    is ready instead of all at once (a :class:`~torchrl_asyncpool.remote.RemoteVectorSlot`:
    one block per host). It has ``step_some(actions, ready)``, which never waits: ``ready``
    marks the envs whose last record the pool has answered; it takes the actions it can use
    now and returns the records it has for ready envs ``(obs, reward, terminated, truncated,
    info)`` (``info["answered"]`` marks them; an env that is not ready keeps its action and
    gets no record), and ``fileno()``, readable when records come. The worker waits on that
    descriptor next to its doorbell, so a slow or silent part of the env holds only its own
    envs.
    """

    path = "gymnasium-vector"

    def __init__(self, env, env_index: int | None = None):
        import gymnasium as gym

        AutoresetMode = gym.vector.AutoresetMode
        where = f"{env_where(env_index)} (a gymnasium vector env)"
        if isinstance(env.unwrapped, gym.vector.AsyncVectorEnv):
            env.close()
            raise TypeError(
                f"{where} is an AsyncVectorEnv, which runs its envs in processes of its own; pool workers cannot "
                "start processes. Return a SyncVectorEnv or a natively vectorized env (gymnasium.make_vec with "
                "vectorization_mode='sync' or 'vector_entry_point'), or pass one single-env factory per env."
            )
        if plan_of(env) is not None:
            raise TypeError(f"{where}: fixed episode plans (evaluate()) need single envs, not a vector env.")
        batch = getattr(env.unwrapped, "batch_size", env.num_envs)
        if isinstance(batch, int) and batch != env.num_envs:
            env.close()
            raise ValueError(
                f"{where} returns {batch} of its {env.num_envs} envs per step (an asynchronous mode, such as "
                "ale-py's AtariVectorEnv with batch_size < num_envs), and its send() takes no env ids: the pool "
                "cannot hand each env its action when the policy answers it. Build it with batch_size=num_envs "
                "(the default) and the pool steps it in lockstep, or use EnvPool's asynchronous mode "
                "(envpool.make_gymnasium(..., batch_size=b)), which the pool hosts env by env."
            )
        mode = env.metadata.get("autoreset_mode", AutoresetMode.NEXT_STEP)
        if mode != AutoresetMode.NEXT_STEP and getattr(mode, "value", mode) != AutoresetMode.NEXT_STEP.value:
            raise ValueError(
                f"{where} autoresets in {mode!r} mode; the pool's episodes follow gymnasium's NEXT_STEP mode "
                "(the vector env's default): build it with autoreset_mode=AutoresetMode.NEXT_STEP."
            )
        self.env = env
        self.num_envs = int(env.num_envs)
        self.partial = bool(env.metadata.get("partial_steps", False))
        if self.partial and not (callable(getattr(env, "step_some", None)) and callable(getattr(env, "fileno", None))):
            raise TypeError(f"{where} declares metadata['partial_steps'] but has no step_some(actions, ready) and "
                            "fileno() methods (see GymnasiumVectorAdapter).")
        self._read_spaces(env.single_observation_space, env.single_action_space, where)
        self._first_seed = own_attr(env, FIRST_SEED_ATTR)

    def random_action(self) -> Dict:
        """A random ``{"action": tensor}`` for one sub-env (from ``single_action_space``)."""
        return {"action": torch.as_tensor(self.env.single_action_space.sample())}

    def reset(self):
        """Resets all ``k`` envs (sub-env ``j`` with the first seed ``+ j`` when set); returns the
        observations, each with a leading ``k``."""
        if self._first_seed is not None:
            obs, _ = _reset_result(self.env.reset(seed=self._first_seed))  # sub-env j gets seed + j (gymnasium's rule)
            self._first_seed = None
        else:
            obs, _ = _reset_result(self.env.reset())
        return self._obs(obs)

    def step(self, actions: Dict):
        """Steps all ``k`` envs with ``actions["action"]`` (``[k, ...]``); returns
        ``(obs, reward, terminated, truncated)``, each with a leading ``k``."""
        obs, reward, terminated, truncated, _ = _step_result(self.env.step(actions["action"].copy()))
        return self._obs(obs), reward, terminated, truncated

    def step_some(self, actions: Dict, ready):
        """For a vector env of partial steps: its ``step_some`` (see the class docstring);
        returns ``(obs, reward, terminated, truncated, answered)``."""
        obs, reward, terminated, truncated, info = self.env.step_some(actions["action"], ready)
        return self._obs(obs), reward, terminated, truncated, np.asarray(info["answered"], bool)

    def fileno(self) -> int:
        """For a vector env of partial steps: the descriptor readable when records are ready."""
        return self.env.fileno()


def _reset_result(out):
    """``env.reset``'s ``(observation, info)``, or a ``ValueError`` saying what the env returned
    instead (an env of the old gym API returns the observation alone, which unpacking would
    split along its first axis when that axis has two entries)."""
    if out.__class__ is not tuple or len(out) != 2:
        raise ValueError(f"env.reset must return (observation, info), as gymnasium envs do, got {out!r:.200}")
    return out


def _step_result(out):
    """``env.step``'s 5-tuple, or the ``ValueError`` the C step loop raises for anything else."""
    if out.__class__ is not tuple or len(out) != 5:
        raise ValueError(f"env.step must return (observation, reward, terminated, truncated, info), got {out!r:.200}")
    return out
