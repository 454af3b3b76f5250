"""Adapters for TorchRL envs stepped through TorchRL itself: one env (:class:`TorchRLEnvAdapter`)
or a batched env hosted in several slots (:class:`TorchRLBatchedAdapter`). The fast path of
:mod:`~torchrl_asyncpool.envs.torchrl_fast` builds on them."""
from __future__ import annotations

from typing import Dict, Tuple

import torch
from tensordict import TensorDict
from torchrl.envs import EnvBase

from torchrl_asyncpool.envs.env_attrs import (
    FIRST_SEED_ATTR, RESERVED_KEYS, env_where, own_attr, plan_of,
)
from torchrl_asyncpool.envs.specs import torchrl_specs

__all__ = ["TorchRLEnvAdapter", "TorchRLBatchedAdapter", "end_flags"]


class TorchRLEnvAdapter:
    """Runs a TorchRL :class:`~torchrl.envs.EnvBase` with an empty batch size in one slot."""

    #: the name of the path the env is stepped on (``adapters.adapter_path``)
    path = "torchrl"
    #: why a TorchRL env is not on the fast path (``None``: it is, or it is not a gym env)
    fast_path_reason = None

    def __init__(self, env: EnvBase, env_index: int | None = None):
        where = env_where(env_index)
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
        self._first_seed = own_attr(env, FIRST_SEED_ATTR)
        self._plan = plan_of(env)
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
        """The slot's TorchRL specs (see :mod:`~torchrl_asyncpool.envs.specs`)."""
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
        if self._plan.cut(truncated) and not terminated:
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
                f"{env_where(env_index)}: fixed episode plans (evaluate()) need single envs, not a batched env."
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
