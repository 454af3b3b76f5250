"""Adapters that give every kind of env the same small interface inside a worker.

The worker loop only needs: the per-slot field specs (read once to size the arena), a
``reset`` and a ``step`` that return the observation entries, the reward and the two end
flags. Keeping this behind one interface is what lets a plain gymnasium env skip all
TensorDict work per step.
"""
from __future__ import annotations

from typing import Dict, Tuple

import numpy as np
import torch
from tensordict import TensorDict
from torchrl.envs import EnvBase

from torchrl_asyncpool.exchange.native import copy_into
from torchrl_asyncpool.workers import torchrl_vector_hosting
from torchrl_asyncpool.workers.env_specs import gymnasium_specs, torchrl_specs

# GymEnv(env_id, num_envs=k) as a factory: a worker (a daemonic process) builds its vector env
# synchronously (see torchrl_vector_hosting); installed here, the module every worker imports
torchrl_vector_hosting.install()

__all__ = [
    "RESERVED_KEYS", "EPISODE_PLAN_ATTR", "FIRST_SEED_ATTR", "TorchRLEnvAdapter", "TorchRLBatchedAdapter",
    "GymnasiumEnvAdapter", "GymnasiumVectorAdapter", "is_vector_env", "make_adapter", "remote_listener", "end_flags",
]

#: Request keys the exchange defines itself; an env observation may not use them.
RESERVED_KEYS = ("reward", "step_type", "done", "terminated", "truncated", "env_index")

#: Attribute an env may carry to fix its episodes: a sequence of ``(seed, max_steps, options)``,
#: one per reset, in order (set by :mod:`torchrl_asyncpool.evaluation`). Each reset takes the
#: next entry: the env is reset with that seed (and, for a gymnasium env, those reset options),
#: and its episode is truncated after ``max_steps`` steps unless it ends first. Resets past the
#: end of the plan are unseeded and unlimited.
EPISODE_PLAN_ATTR = "_torchrl_asyncpool_episode_plan"

#: Attribute an env may carry to seed its first reset (set by ``AsyncEnvPool(seed=...)``): a
#: gymnasium env is reset with ``seed=`` once (a vector env seeds its sub-envs from it, as
#: gymnasium does), a TorchRL env gets ``set_seed`` before its first reset; later resets continue
#: the env's own random stream. An episode plan, where there is one, takes precedence.
FIRST_SEED_ATTR = "_torchrl_asyncpool_first_seed"


class _EpisodePlan:
    """The per-reset (seed, step limit) of an env that carries :data:`EPISODE_PLAN_ATTR`."""

    def __init__(self, plan):
        self.plan = list(plan)
        self.episode = -1
        self.limit = None
        self.t = 0

    def next_reset(self):
        """``(seed, options)`` of the next episode; sets its step limit."""
        self.episode += 1
        seed, self.limit, options = self.plan[self.episode] if self.episode < len(self.plan) else (None, None, None)
        self.t = 0
        return seed, options

    def cut(self) -> bool:
        """Counts a step; True when it reaches the episode's step limit."""
        self.t += 1
        return self.limit is not None and self.t >= self.limit


def _own_attr(env, name):
    # the instance's own attribute only: batched TorchRL envs forward unknown attributes to
    # their (possibly not yet built) sub-envs
    try:
        return vars(env).get(name)
    except TypeError:  # no __dict__
        return None


def _plan_of(env):
    plan = _own_attr(env, EPISODE_PLAN_ATTR)
    return None if plan is None else _EpisodePlan(plan)


class TorchRLEnvAdapter:
    """Runs a TorchRL :class:`~torchrl.envs.EnvBase` with an empty batch size in one slot."""

    #: the name of the path the env is stepped on (``torchrl_fast.adapter_path``)
    path = "torchrl"
    #: why a TorchRL env is not on the fast path (``None``: it is, or it is not a gym env)
    fast_path_reason = None

    def __init__(self, env: EnvBase, env_index: int | None = None):
        where = _where(env_index)
        if not isinstance(env, EnvBase):
            raise TypeError(
                f"create_env_fn for {where} returned {type(env).__name__}; expected a torchrl.envs.EnvBase."
            )
        if len(env.batch_size) != self._batch_dims:
            raise ValueError(
                f"{where} has batch_size {tuple(env.batch_size)}; AsyncEnvPool hosts an env with batch_size=() in "
                "one slot, or a batched env with a 1-d batch_size=[k] in k slots stepped in lockstep."
            )
        self.env = env
        self.obs_keys = [k for k in env.observation_spec.keys(True, True)]
        for k in self.obs_keys:
            if (k if isinstance(k, str) else k[0]) in RESERVED_KEYS:
                raise ValueError(f"{where}: observation key {k!r} collides with a reserved key {RESERVED_KEYS}.")
        rk = env.reward_keys
        if len(rk) != 1:
            raise ValueError(f"{where} has {len(rk)} reward keys {rk}; exactly one is supported.")
        self.reward_key = rk[0]
        self.action_keys = list(env.action_keys)
        done_spec = env.full_done_spec
        b = self._batch_dims
        self._done_shape = tuple(done_spec["done"].shape)[b:]
        self._td = None
        self._first_seed = _own_attr(env, FIRST_SEED_ATTR)
        self._plan = _plan_of(env)
        if self._plan is not None:  # the plain step stays free of the plan's bookkeeping
            self.step = self._planned_step

    #: leading batch dimensions of the env (the slot fields are the specs without them)
    _batch_dims = 0

    def fields(self) -> Tuple[Dict, Dict]:
        """``(request, response)`` field specs ``{key: (shape, dtype)}`` for one slot."""
        env, b = self.env, self._batch_dims
        obs_spec = env.observation_spec
        request = {k: (tuple(obs_spec[k].shape)[b:], obs_spec[k].dtype) for k in self.obs_keys}
        reward_spec = env.full_reward_spec[self.reward_key]
        request["reward"] = (tuple(reward_spec.shape)[b:], reward_spec.dtype)
        request["step_type"] = ((), torch.int8)
        for k in ("done", "terminated", "truncated"):
            request[k] = (self._done_shape, torch.bool)
        action_spec = env.full_action_spec
        response = {k: (tuple(action_spec[k].shape)[b:], action_spec[k].dtype) for k in self.action_keys}
        return request, response

    def specs(self) -> Dict:
        """The slot's TorchRL specs (see :mod:`~torchrl_asyncpool.workers.env_specs`)."""
        return torchrl_specs(self.env, self._batch_dims, self.obs_keys, self.reward_key, self.action_keys,
                             self.fields())

    @staticmethod
    def as_numpy(value):
        """Observation entries as numpy arrays (the worker writes the arena through numpy)."""
        return value.detach().numpy() if value.requires_grad else value.numpy()

    def random_action(self) -> Dict:
        """A random action ``{action key: tensor}`` drawn from the env's action spec."""
        spec = self.env.full_action_spec
        return {k: spec[k].rand() for k in self.action_keys}

    def reset(self):
        """Resets the env; returns a mapping ``key -> tensor`` holding the observation."""
        self._seed_reset()
        self._td = self.env.reset()
        return self._td

    def _seed_reset(self):
        """Seeds the coming reset through TorchRL's ``set_seed`` when a seed is due: the episode
        plan's, or the first reset's; a plan's reset options are refused (a TorchRL env has none)."""
        if self._plan is not None:
            seed, options = self._plan.next_reset()
            if options is not None:
                raise ValueError(
                    f"episode reset options {options!r} need a gymnasium env; a TorchRL env is reset with a seed only."
                )
            if seed is not None:
                self.env.set_seed(seed)
        elif self._first_seed is not None:
            self.env.set_seed(self._first_seed)  # TorchRL's seeding: gymnasium reset(seed=...) once
        self._first_seed = None

    def _planned_step(self, actions: Dict):
        obs, reward, terminated, truncated = TorchRLEnvAdapter.step(self, actions)
        if self._plan.cut() and not terminated:
            truncated = True
        return obs, reward, terminated, truncated

    def step(self, actions: Dict) -> Tuple[object, torch.Tensor, bool, bool]:
        """Steps with ``actions`` (key -> tensor); returns ``(obs, reward, terminated, truncated)``."""
        td = self._td
        for k, v in actions.items():
            td.set(k, v.clone())
        # ``_step`` directly, as TorchRL's own ParallelEnv workers do: ``step`` would add
        # ~45 us of per-call spec bookkeeping that the arena layout already fixed once.
        nxt = self.env._step(td)
        self._td = nxt
        terminated, truncated = end_flags(nxt)
        return nxt, nxt.get(self.reward_key), terminated, truncated

    def close(self) -> None:
        """Closes the env; an error while closing is swallowed (it must not mask the real one)."""
        try:
            self.env.close()
        except Exception:  # noqa: BLE001 - closing a half-broken env must not mask the real error
            pass


def _flag(td, key):
    value = td.get(key, None)
    if value is None:
        return None
    # a one-element flag (the usual [1]) read directly: ~0.2 us where .any() costs ~1 us, three
    # times per step of every TorchRL env on TorchRL's stepping
    return bool(value) if value.numel() == 1 else bool(value.any())


def end_flags(td) -> Tuple[bool, bool]:
    """``(terminated, truncated)`` of a TorchRL step's output ``td``; an env that only writes
    ``"done"`` counts as terminated, and ``done`` without ``terminated`` as truncated."""
    done = _flag(td, "done")
    term = _flag(td, "terminated")
    trunc = _flag(td, "truncated")
    terminated = done if term is None else term
    truncated = bool(done) and not terminated if trunc is None else trunc
    return terminated, truncated


class TorchRLBatchedAdapter(TorchRLEnvAdapter):
    """Runs a TorchRL :class:`~torchrl.envs.EnvBase` with ``batch_size=[k]`` in ``k`` consecutive slots.

    The slot fields are the env's specs without the batch dimension. :meth:`reset` and
    :meth:`step` work on all ``k`` envs at once (numpy arrays with a leading ``k``). TorchRL
    envs do not reset themselves: an env that ended is reset with a partial reset
    (``"_reset"`` mask, :meth:`reset_some`) on the worker's next pass, which publishes only
    those ``FIRST`` records; the other envs' answered actions wait for that pass, since a
    batched env steps all its envs together. The env must not reset itself inside ``step``.
    """

    _batch_dims = 1
    path = "torchrl-batched"
    #: ``False``: ended envs are reset by :meth:`reset_some`, not by the next :meth:`step`
    autoresets = False

    def __init__(self, env: EnvBase, env_index: int | None = None):
        super().__init__(env, env_index)
        if self._plan is not None:
            raise TypeError(
                f"{_where(env_index)}: fixed episode plans (evaluate()) need single envs, not a batched env."
            )
        self.num_envs = int(env.batch_size[0])
        self._reset_shape = (self.num_envs, *self._done_shape)

    def _obs(self, td):
        return {k: self.as_numpy(td.get(k)) for k in self.obs_keys}

    def reset(self):
        if self._first_seed is not None:  # the batched env seeds its sub-envs, as TorchRL does
            self.env.set_seed(self._first_seed)
            self._first_seed = None
        self._td = self.env.reset()
        return self._obs(self._td)

    def reset_some(self, mask):
        """Resets the envs where ``mask`` (bool ``[k]``) is set; returns the observations (rows of
        the other envs are unspecified)."""
        m = torch.from_numpy(mask)
        out = self.env.reset(TensorDict({"_reset": m.reshape(self._reset_shape)}, [self.num_envs]))
        td = self._td  # the next step reads it: the reset rows take their new state
        have = set(td.keys(True, True))
        for key in out.keys(True, True):
            if key != "_reset" and key in have:
                dst = td.get(key)
                # TorchRL's batched GymWrapper returns the end flags as [k] from _step but [k, 1]
                # from reset: the rows keep the shape the next step reads
                dst[m] = out.get(key)[m].reshape(dst[m].shape)
        return self._obs(out)

    def step(self, actions: Dict):
        td = self._td
        for k, v in actions.items():
            td.set(k, torch.from_numpy(v).clone())
        nxt = self._td = self.env._step(td)  # ``_step``, as in TorchRLEnvAdapter.step
        k = self.num_envs
        done = nxt.get("done").reshape(k, -1).any(-1)
        term = nxt.get("terminated", None)
        trunc = nxt.get("truncated", None)
        terminated = done if term is None else term.reshape(k, -1).any(-1)
        truncated = done & ~terminated if trunc is None else trunc.reshape(k, -1).any(-1)
        return self._obs(nxt), self.as_numpy(nxt.get(self.reward_key)), terminated.numpy(), truncated.numpy()


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
        self._read_spaces(env.observation_space, env.action_space, _where(env_index))
        self._first_seed = _own_attr(env, FIRST_SEED_ATTR)
        self._plan = _plan_of(env)
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
            self._action = (tuple(a.shape), _torch_dtype(a.dtype))
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
                request[k] = (tuple(sp.shape), _torch_dtype(sp.dtype))
        request["reward"] = ((1,), torch.float32)
        request["step_type"] = ((), torch.int8)
        for k in ("done", "terminated", "truncated"):
            request[k] = ((1,), torch.bool)
        return request, {"action": self._action}

    def specs(self) -> Dict:
        """The slot's TorchRL specs, as ``GymEnv`` converts the spaces (see
        :mod:`~torchrl_asyncpool.workers.env_specs`)."""
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
            obs, _ = self.env.reset(seed=seed, options=options)
        elif self._first_seed is not None:
            obs, _ = self.env.reset(seed=self._first_seed)
            self._first_seed = None
        else:  # no seed argument at all: some envs' reset() does not take one
            obs, _ = self.env.reset()
        return self._obs(obs)

    def _planned_step(self, actions: Dict):
        obs, reward, terminated, truncated = GymnasiumEnvAdapter.step(self, actions)
        if self._plan.cut() and not terminated:
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
        obs, reward, terminated, truncated, _ = self.env.step(self._action_value(actions))
        return self._obs(obs), reward, bool(terminated), bool(truncated)

    def step_into(self, actions: Dict, views):
        """:meth:`step` that writes the observation into ``views`` (the slot's
        ``[(key, numpy row)]``) and returns ``(reward, terminated, truncated)``: the worker's
        per-step path, with no dict built and no lookup per step."""
        if self._plan is not None:
            obs, reward, terminated, truncated = self._planned_step(actions)
            for key, view in views:
                copy_into(view, obs[key])
            return reward, terminated, truncated
        obs, reward, terminated, truncated, _ = self.env.step(self._action_value(actions))
        if self._dict_obs:
            for key, view in views:
                copy_into(view, obs[key])
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
    """

    path = "gymnasium-vector"

    def __init__(self, env, env_index: int | None = None):
        import gymnasium as gym

        AutoresetMode = gym.vector.AutoresetMode
        where = f"{_where(env_index)} (a gymnasium vector env)"
        if isinstance(env.unwrapped, gym.vector.AsyncVectorEnv):
            env.close()
            raise TypeError(
                f"{where} is an AsyncVectorEnv, which runs its envs in processes of its own; pool workers cannot "
                "start processes. Return a SyncVectorEnv or a natively vectorized env (gymnasium.make_vec with "
                "vectorization_mode='sync' or 'vector_entry_point'), or pass one single-env factory per env."
            )
        if _plan_of(env) is not None:
            raise TypeError(f"{where}: fixed episode plans (evaluate()) need single envs, not a vector env.")
        mode = env.metadata.get("autoreset_mode", AutoresetMode.NEXT_STEP)
        if mode != AutoresetMode.NEXT_STEP and getattr(mode, "value", mode) != AutoresetMode.NEXT_STEP.value:
            raise ValueError(
                f"{where} autoresets in {mode!r} mode; the pool's episodes follow gymnasium's NEXT_STEP mode "
                "(the vector env's default): build it with autoreset_mode=AutoresetMode.NEXT_STEP."
            )
        self.env = env
        self.num_envs = int(env.num_envs)
        self._read_spaces(env.single_observation_space, env.single_action_space, where)
        self._first_seed = _own_attr(env, FIRST_SEED_ATTR)

    def random_action(self) -> Dict:
        """A random ``{"action": tensor}`` for one sub-env (from ``single_action_space``)."""
        return {"action": torch.as_tensor(self.env.single_action_space.sample())}

    def reset(self):
        """Resets all ``k`` envs (sub-env ``j`` with the first seed ``+ j`` when set); returns the
        observations, each with a leading ``k``."""
        if self._first_seed is not None:
            obs, _ = self.env.reset(seed=self._first_seed)  # sub-env j gets seed + j (gymnasium's rule)
            self._first_seed = None
        else:
            obs, _ = self.env.reset()
        return self._obs(obs)

    def step(self, actions: Dict):
        """Steps all ``k`` envs with ``actions["action"]`` (``[k, ...]``); returns
        ``(obs, reward, terminated, truncated)``, each with a leading ``k``."""
        obs, reward, terminated, truncated, _ = self.env.step(actions["action"].copy())
        return self._obs(obs), reward, terminated, truncated


def _torchrl_adapter(env, env_index):
    from torchrl_asyncpool.workers import torchrl_fast as fast

    batched = is_vector_env(env)
    if not _wraps_gym(env):  # any other TorchRL env: TorchRL's stepping, nothing to log
        return TorchRLBatchedAdapter(env, env_index) if batched else TorchRLEnvAdapter(env, env_index)
    try:
        plan = fast.fast_plan(env, batched=batched)
    except fast.FastPathUnsupported as exc:
        reason = str(exc)
    else:
        if batched:
            adapter = fast.TorchRLGymVectorFastAdapter(env, plan, env_index)
        else:
            adapter = fast.TorchRLGymFastAdapter(env, plan, env_index)
        fast._log_choice(adapter, env, env_index)
        return adapter
    if batched and _next_step_vector(env):
        what = _describe_vector(env)
        try:
            env.close()
        except Exception:  # noqa: BLE001 - the refusal below is the error to report
            pass
        raise TypeError(
            f"create_env_fn for {_where(env_index)} returned {what}, which the pool cannot host: {reason}. TorchRL's "
            "own stepping of a gymnasium NEXT_STEP vector env does not give valid records at episode ends, so the "
            "pool hosts it only on its fast path (GymEnv(env_id, num_envs=k), optionally transformed by the "
            "transforms the fast path supports, see torchrl_asyncpool.workers.torchrl_fast). Pass one "
            "GymEnv(env_id) factory per env instead (any transforms), or a gymnasium vector env."
        )
    adapter = TorchRLBatchedAdapter(env, env_index) if batched else TorchRLEnvAdapter(env, env_index)
    adapter.fast_path_reason = reason
    fast._log_choice(adapter, env, env_index, reason)
    return adapter


def _describe_vector(env) -> str:
    """``TransformedEnv(GymEnv('CartPole-v1', num_envs=2), ...)``-style name of a batched gym env."""
    from torchrl.envs import TransformedEnv

    layers = 0
    base = env
    while isinstance(base, TransformedEnv):
        base, layers = base.base_env, layers + 1
    name = getattr(base, "_constructor_kwargs", {}).get("env_name")
    inner = f"{type(base).__name__}({name!r}, num_envs={base.batch_size[0]})" if name else type(base).__name__
    return "TransformedEnv(" * layers + inner + ", ...)" * layers


def _wraps_gym(env) -> bool:
    """True for a TorchRL ``GymWrapper`` (or a ``TransformedEnv`` chain ending in one)."""
    from torchrl.envs import TransformedEnv
    from torchrl.envs.libs.gym import GymWrapper

    while isinstance(env, TransformedEnv):
        env = env.base_env
    return isinstance(env, GymWrapper)


def _next_step_vector(env) -> bool:
    """True when ``env`` wraps a gymnasium vector env that autoresets in NEXT_STEP mode."""
    from torchrl.envs import TransformedEnv

    while isinstance(env, TransformedEnv):
        env = env.base_env
    try:
        import gymnasium as gym

        inner = env._env
        if not isinstance(inner.unwrapped, gym.vector.VectorEnv):
            return False
        mode = inner.metadata.get("autoreset_mode", gym.vector.AutoresetMode.NEXT_STEP)
        return getattr(mode, "value", mode) == gym.vector.AutoresetMode.NEXT_STEP.value
    except Exception:  # noqa: BLE001 - not a gymnasium vector env
        return False


def _where(env_index) -> str:
    return f"env {env_index}" if env_index is not None else "the env"


def _torch_dtype(np_dtype) -> torch.dtype:
    import numpy as np

    return torch.from_numpy(np.zeros((), dtype=np_dtype)).dtype


def is_vector_env(env) -> bool:
    """True for what the pool hosts in several slots: a gymnasium vector env, or a TorchRL env
    with a non-empty batch size (only ``batch_size=[k]`` is accepted)."""
    if isinstance(env, EnvBase):
        return len(env.batch_size) > 0
    try:
        import gymnasium as gym
    except ImportError:  # pragma: no cover - gymnasium is a dependency
        return False
    return isinstance(env, gym.vector.VectorEnv)


def remote_listener(env):
    """The ``listen(slot_index, stop_fd)`` hook of a remote env slot
    (:class:`~torchrl_asyncpool.remote.RemoteEnvSlot`, possibly wrapped), or ``None`` for an
    env stepped here."""
    return getattr(getattr(env, "unwrapped", env), "_pool_listen", None)


def make_adapter(env, env_index: int | None = None):
    """Wraps whatever ``create_env_fn`` returned in the matching adapter.

    A TorchRL env over a gymnasium env is stepped on the fast path
    (:mod:`~torchrl_asyncpool.workers.torchrl_fast`) when its records are proven to be
    TorchRL's, else through TorchRL; the choice is logged at debug level
    (``torchrl_asyncpool.workers.torchrl_fast``) and kept in ``adapter.path`` and
    ``adapter.fast_path_reason``.
    """
    if isinstance(env, EnvBase):
        return _torchrl_adapter(env, env_index)
    try:
        import gymnasium as gym
    except ImportError:  # pragma: no cover - gymnasium is a dependency
        gym = None
    if gym is not None and isinstance(env, gym.Env):
        return GymnasiumEnvAdapter(env, env_index)
    if gym is not None and isinstance(env, gym.vector.VectorEnv):
        return GymnasiumVectorAdapter(env, env_index)
    raise TypeError(
        f"create_env_fn for {_where(env_index)} returned {type(env).__name__}; expected a torchrl.envs.EnvBase, "
        "a gymnasium.Env or a gymnasium.vector.VectorEnv."
    )
