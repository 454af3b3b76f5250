"""TorchRL envs behind the env-host protocol: a gymnasium-API view of an :class:`~torchrl.envs.EnvBase`.

The protocol speaks in flat observation keys, one ``"action"`` entry and a scalar reward (see
:mod:`torchrl_asyncpool.remote.protocol`). :class:`TorchRLEnvView` presents a TorchRL env with
an empty batch size that way, so that :class:`~torchrl_asyncpool.remote.EnvHost` can serve it
and :meth:`RemoteEnvSlot.like <torchrl_asyncpool.remote.RemoteEnvSlot.like>` can copy its
layout: each observation entry becomes a ``Box`` of its shape and dtype (a ``Discrete`` for a
scalar ``Categorical``), the action likewise. The pool then sees exactly the entries, shapes
and dtypes a local pool of the same env would carry (a one-hot action stays one-hot).
"""
from __future__ import annotations

import gymnasium as gym
import numpy as np
import torch
from torchrl.envs import EnvBase
from torchrl.envs.utils import step_mdp

from torchrl_asyncpool.envs.torchrl_adapters import end_flags

__all__ = ["TorchRLEnvView", "as_gymnasium"]


def as_gymnasium(env):
    """``env`` itself for a gymnasium env, a :class:`TorchRLEnvView` for a TorchRL env."""
    return TorchRLEnvView(env) if isinstance(env, EnvBase) else env


def _space(spec, what: str):
    from torchrl.data import Categorical

    dtype = torch.empty((), dtype=spec.dtype).numpy().dtype
    if isinstance(spec, Categorical) and tuple(spec.shape) == ():
        return gym.spaces.Discrete(spec.space.n)
    if dtype.kind == "f":
        return gym.spaces.Box(-np.inf, np.inf, tuple(spec.shape), dtype)
    if dtype.kind in "iub":
        info = np.iinfo(dtype) if dtype.kind != "b" else None
        low, high = (0, 1) if info is None else (info.min, info.max)
        return gym.spaces.Box(low, high, tuple(spec.shape), dtype)
    raise TypeError(f"{what} has dtype {spec.dtype}, which a remote env cannot carry.")


class TorchRLEnvView(gym.Env):
    """A TorchRL env with ``batch_size=()`` seen through the gymnasium API.

    Observation entries must have plain string keys (nested keys are refused), the action must
    be the single entry ``"action"`` and the reward must hold one value.

    Args:
        env (EnvBase): the env; stepped with ``env.step`` and reset with ``env.reset``.

    Examples:
        >>> from torchrl_asyncpool.remote.torchrl_env import TorchRLEnvView
        >>> from torchrl_asyncpool.testing import OracleEnv
        >>> view = TorchRLEnvView(OracleEnv(env_id=2))
        >>> sorted(view.observation_space.spaces), view.action_space
        (['echo', 'observation', 'tag'], Discrete(1000))
        >>> obs, _ = view.reset()
        >>> obs["tag"].tolist()
        [2, 0, 0]
    """

    metadata = {"render_modes": []}

    def __init__(self, env: EnvBase):
        if len(env.batch_size):
            raise ValueError(f"a remote env must have batch_size=(), got {tuple(env.batch_size)}.")
        keys = list(env.observation_spec.keys(True, True))
        nested = [k for k in keys if not isinstance(k, str)]
        if nested:
            raise TypeError(f"a remote TorchRL env needs flat observation keys; {nested} are nested.")
        if list(env.action_keys) != ["action"]:
            raise TypeError(f"a remote TorchRL env needs the single action key 'action', got {env.action_keys}.")
        if len(env.reward_keys) != 1 or env.full_reward_spec[env.reward_keys[0]].shape.numel() != 1:
            raise TypeError("a remote TorchRL env needs one reward entry holding one value.")
        self.env = env
        self._keys = keys
        self._reward_key = env.reward_keys[0]
        self.observation_space = gym.spaces.Dict(
            {k: _space(env.observation_spec[k], f"observation {k!r}") for k in keys}
        )
        self.action_space = _space(env.full_action_spec["action"], "the action")
        self._action_dtype = env.full_action_spec["action"].dtype
        self._td = None

    def _obs(self, td):
        return {k: td.get(k).numpy() for k in self._keys}

    def reset(self, *, seed=None, options=None):
        """Resets the env (``env.set_seed(seed)`` first when ``seed`` is given; ``options`` is
        ignored); returns ``(observation dict of numpy arrays, {})``."""
        if seed is not None:
            self.env.set_seed(seed)
        self._td = self.env.reset()
        return self._obs(self._td), {}

    def step(self, action):
        """Steps the env with ``action`` as its ``"action"`` entry; returns ``(observation,
        reward, terminated, truncated, {})`` as gymnasium does."""
        td = self._td.set("action", torch.as_tensor(np.asarray(action), dtype=self._action_dtype))
        nxt = self.env.step(td).get("next")
        reward = float(nxt.get(self._reward_key).reshape(-1)[0])
        terminated, truncated = end_flags(nxt)
        self._td = step_mdp(td)
        return self._obs(nxt), reward, terminated, truncated, {}

    def close(self):
        """Closes the TorchRL env."""
        self.env.close()
