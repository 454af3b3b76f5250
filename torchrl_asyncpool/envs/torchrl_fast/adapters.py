"""The adapters that step a TorchRL gym env on the fast path: one env in one slot
(:class:`TorchRLGymFastAdapter`), ``GymEnv(env_id, num_envs=k)`` in ``k`` slots in lockstep
(:class:`TorchRLGymVectorFastAdapter`) or split into ``k`` slots of their own
(:class:`VectorSubEnvAdapter`), and the debug log line that says which path an env took
(:func:`log_choice`)."""
from __future__ import annotations

import logging
from typing import Dict, Optional

import numpy as np

from torchrl_asyncpool.exchange.native import copy_into
from torchrl_asyncpool.envs.env_attrs import env_where
from torchrl_asyncpool.envs.torchrl_adapters import TorchRLBatchedAdapter, TorchRLEnvAdapter
from torchrl_asyncpool.envs.torchrl_fast.unsupported import FastPathUnsupported

__all__ = ["TorchRLGymFastAdapter", "TorchRLGymVectorFastAdapter", "VectorSubEnvAdapter", "log_choice"]

# the package's logger (``torchrl_asyncpool.envs.torchrl_fast``), the name the docs give
log = logging.getLogger(__package__)


class TorchRLGymFastAdapter(TorchRLEnvAdapter):
    """Runs a TorchRL ``GymEnv``/``GymWrapper`` (optionally transformed) in one slot by stepping
    its gymnasium env directly: the records TorchRL's ``_step`` would make, without TensorDicts.

    The slot layout, specs, seeding and episode plans are :class:`TorchRLEnvAdapter`'s (the
    TorchRL env's own specs; ``set_seed`` through TorchRL, once per seed); only ``reset`` and
    ``step`` bypass TorchRL. Built by ``make_adapter`` when :func:`fast_plan` accepts the env.

    Args:
        env: the TorchRL env.
        plan: :func:`fast_plan` of ``env``.
        env_index (int, optional): the slot, for error messages.

    Examples:
        >>> from torchrl.envs import GymEnv
        >>> from torchrl_asyncpool.envs.adapters import make_adapter
        >>> adapter = make_adapter(GymEnv("CartPole-v1"))
        >>> adapter.path
        'torchrl-fast'
        >>> adapter.reset()["observation"].dtype
        dtype('float32')
        >>> adapter.close()
    """

    #: the worker hands ``step``/``step_into`` numpy views of the action rows
    takes_numpy = True
    #: the name of this path (:func:`adapter_path`)
    path = "torchrl-fast"

    @staticmethod
    def as_numpy(value):
        """Record entries are numpy already."""
        return value

    def __init__(self, env, plan, env_index: Optional[int] = None):
        super().__init__(env, env_index)
        if list(self.obs_keys) != list(plan.obs_keys) and set(self.obs_keys) != set(plan.obs_keys):
            raise FastPathUnsupported("observation keys differ")
        self.plan = plan
        self.gym = plan.base._env
        self.transforms = plan.transforms
        self._direct = None
        # the direct step's StepCounter count and RewardSum total (int64 / float32 [1]): arrays,
        # which the C pass loop advances as the Python one does (see c_step)
        self._count, self._sum = np.zeros(1, np.int64), np.zeros(1, np.float32)
        # the worker's _Slot reads ``self.step`` once: keep the planned variant when there is a plan
        if self._plan is not None:
            self.step = self._planned_step
            self.step_into = self._planned_step_into
        elif plan.plain():
            self.step_into = self._plain_step_into
        else:
            self._direct = plan.direct()
            if self._direct is not None:
                self._views = self._rows = None
                self.step_into = self._direct_step_into

    def random_action(self) -> Dict:
        """A random action ``{"action": tensor}`` from the env's action spec."""
        spec = self.env.full_action_spec
        return {k: spec[k].rand() for k in self.action_keys}

    def reset(self):
        """Resets the gymnasium env (seeded through TorchRL's ``set_seed`` when a seed is due);
        returns the record's observation entries (numpy)."""
        self._seed_reset()
        obs, _ = self.gym.reset()
        rec = self.plan.record(obs)
        for t in self.transforms:
            t.reset(rec)
        self._count[0], self._sum[0] = 0, 0
        return rec

    def c_step(self, views):
        """What the worker's pass loop needs to step this env in C (``exchange.native.step_group``)
        into the slot's rows ``views`` (``[(key, numpy row)]``): ``(gym_env.step, action maker,
        observation row, step count, reward sum)``, the count ``(state, row, max_steps or 0)`` and
        the sum ``(state, row)`` or ``None`` where there is no ``StepCounter``/``RewardSum``; ``None``
        where the env steps in Python (episode plans, frame skipping, the record path, rows of
        other dtypes). Both loops make the same records: :meth:`step_into` advances the same
        state arrays."""
        if self._plan is not None or self.plan.frame_skip != 1:
            return None
        if self.step_into == self._plain_step_into:
            return self.gym.step, self.plan.action, views[0][1], None, None
        d = self._direct
        if d is None:
            return None
        self._bind_rows(views)  # the rows the direct step writes
        obs_row, count_row, sum_row = self._rows
        count = total = None
        if count_row is not None:
            if count_row.dtype != np.int64 or count_row.shape != (1,):
                return None
            count = (self._count, count_row, d.counter.max_steps or 0)
        if sum_row is not None:
            if sum_row.dtype != np.float32 or sum_row.shape != (1,):
                return None
            total = (self._sum, sum_row)
        return self.gym.step, d.action, obs_row, count, total

    def _gym_run(self, a):
        """``gym.step(a)`` repeated ``frame_skip`` times as ``GymLikeEnv._step`` repeats it (the
        rewards summed, stopping at the first end): ``(obs, reward, terminated, truncated)``."""
        if self.plan.frame_skip == 1:
            return self.gym.step(a)[:4]
        reward = 0
        for _ in range(self.plan.frame_skip):
            obs, r, terminated, truncated, _ = self.gym.step(a)
            if r is not None:
                reward = reward + r
            if terminated or truncated:
                break
        return obs, reward, terminated, truncated

    def _gym_step(self, actions):
        plan = self.plan
        obs, reward, terminated, truncated = self._gym_run(plan.action(actions["action"]))
        reward = np.asarray(reward, dtype=np.float32).reshape(1)  # reward_spec.encode
        rec = plan.record(obs)
        terminated, truncated = bool(terminated), bool(truncated)
        for t in self.transforms:
            reward, terminated, truncated = t.step(rec, reward, terminated, truncated)
        return rec, reward, terminated, truncated

    def step(self, actions: Dict):
        """Steps with ``actions`` (numpy rows); returns ``(obs entries, reward, terminated, truncated)``."""
        return self._gym_step(actions)

    def _planned_step(self, actions):
        rec, reward, terminated, truncated = self._gym_step(actions)
        if self._plan.cut(truncated) and not terminated:
            truncated = True
        return rec, reward, terminated, truncated

    def step_into(self, actions: Dict, views):
        """:meth:`step` writing the observation entries into ``views`` (``[(key, numpy row)]``);
        returns ``(reward, terminated, truncated)``."""
        rec, reward, terminated, truncated = self._gym_step(actions)
        for key, view in views:
            copy_into(view, rec[key], key)
        return reward, terminated, truncated

    def _planned_step_into(self, actions, views):
        rec, reward, terminated, truncated = self._planned_step(actions)
        for key, view in views:
            copy_into(view, rec[key], key)
        return reward, terminated, truncated

    def _direct_step_into(self, actions, views):
        # the record path's result without building the record (plan.direct): the observation
        # copied into its row (the copy casts as DoubleToFloat does), the count and the sum
        # written into theirs; ~5 us a step less than the record path on a MuJoCo env. The
        # worker's C pass loop does the same (c_step), on the same state arrays.
        d = self._direct
        obs, reward, terminated, truncated = self._gym_run(d.action(actions["action"]))
        if views is not self._views:
            self._bind_rows(views)
        obs_row, count_row, sum_row = self._rows
        copy_into(obs_row, obs)
        truncated = bool(truncated)
        if count_row is not None:
            count = self._count
            count += 1
            count_row[0] = count[0]
            max_steps = d.counter.max_steps
            truncated = truncated or (max_steps is not None and count[0] >= max_steps)
        reward = np.float32(reward)  # reward_spec.encode (torch.as_tensor(reward, float32))
        if sum_row is not None:
            total = self._sum
            total += reward
            sum_row[0] = total[0]
        return reward, bool(terminated), bool(truncated)

    def _bind_rows(self, views):
        rows = dict(views)
        d = self._direct
        self._rows = (rows[d.obs_key], None if d.counter is None else rows[d.counter.key],
                      None if d.summer is None else rows[d.summer.key])
        self._views = views

    def _plain_step_into(self, actions, views):
        # GymEnv without transforms, one Box observation: the gymnasium adapter's path (the
        # arena's row has the spec's dtype and shape; the copy casts as torch.as_tensor would)
        obs, reward, terminated, truncated, _ = self.gym.step(self.plan.action(actions["action"]))
        copy_into(views[0][1], obs)
        return reward, bool(terminated), bool(truncated)  # the arena's float32 row rounds as encode does


class TorchRLGymVectorFastAdapter(TorchRLBatchedAdapter):
    """Runs TorchRL's ``GymEnv(env_id, num_envs=k)`` in ``k`` slots of one worker, stepping its
    gymnasium vector env directly in lockstep.

    In a pool worker the vector env is a ``SyncVectorEnv`` (see
    :mod:`~torchrl_asyncpool.envs.torchrl_vector_hosting`); it autoresets in gymnasium's
    ``NEXT_STEP`` mode, the pool's episode contract. Sub-env ``j`` produces the records of
    ``GymEnv(env_id)`` seeded with ``seed + j``: TorchRL's ``set_seed`` seeds the vector env's
    sub-envs ``seed + j`` with one ``reset(seed=...)``, as each single env's ``set_seed`` does,
    and every later reset is unseeded in both.

    Transforms on top (``TransformedEnv(GymEnv(env_id, num_envs=k), ...)``) are applied row by
    row, each sub-env's as ``TransformedEnv(GymEnv(env_id), ...)`` applies them: the supported
    ones of :class:`TorchRLGymFastAdapter` except ``StepCounter(max_steps=...)`` (its truncation
    would need the vector env to reset that env; pass ``max_episode_steps`` to ``GymEnv``).

    ``GymWrapper`` over a vector env that does not autoreset (``AutoresetMode.DISABLED``, no
    transforms) is stepped the same way, its ended envs reset as TorchRL resets them, with one
    ``reset(options={"reset_mask": mask})`` (:meth:`reset_some`, ``autoresets`` is False).

    (TorchRL's own stepping of such an env does not give valid records at episode ends under
    gymnasium >= 1.0: with ``NEXT_STEP`` autoreset there is no final observation in the info,
    so its ``VecGymEnvTransform`` reports the terminal observation as missing and the reset
    observation one step late. This adapter is the only way the pool hosts it.)

    Args:
        env: the TorchRL env (``TransformedEnv(GymEnv, VecGymEnvTransform)``, as ``GymEnv``
            builds it).
        plan: :func:`fast_plan` of ``env`` with ``batched=True``.
        env_index (int, optional): the first slot, for error messages.
    """

    takes_numpy = True
    path = "torchrl-fast-vector"

    @staticmethod
    def as_numpy(value):
        """Record entries are numpy already."""
        return value

    #: ``True``: the vector env resets an ended env itself, at its next step (NEXT_STEP)
    autoresets = True

    def __init__(self, env, plan, env_index: Optional[int] = None):
        super().__init__(env, env_index)
        self.obs_keys = list(plan.obs_keys)  # the slot layout and specs follow (no "final" entries)
        self.plan = plan
        self.vec = plan.base._env
        self.autoresets = plan.autoresets

    def reset(self):
        """Resets all ``k`` envs (sub-env ``j`` seeded ``seed + j`` through TorchRL's ``set_seed``
        when a first seed is set); returns the observations, each with a leading ``k``."""
        if self._first_seed is not None:
            self.env.set_seed(self._first_seed)
            self._first_seed = None
        obs, _ = self.vec.reset()
        rec = self._vrecord(obs)
        for t in self.plan.transforms:
            t.vreset(rec, self.num_envs)
        self._first = np.zeros(self.num_envs, bool)
        return rec

    def _vrecord(self, obs):
        k = self.num_envs
        if not self.plan.dict_obs:
            _, key, dtype, shape = self.plan.readers[0]
            return {key: np.asarray(obs, dtype=dtype).reshape((k, *shape))}
        return {key: np.asarray(obs[g], dtype=dtype).reshape((k, *shape)) for g, key, dtype, shape in self.plan.readers}

    def step(self, actions: Dict):
        """Steps all ``k`` envs with the ``[k, ...]`` action rows; returns ``(obs, reward,
        terminated, truncated)``, each with a leading ``k`` (NEXT_STEP: an env that ended last
        step ignores its action and returns its reset observation)."""
        obs, reward, terminated, truncated, _ = self.vec.step(self.plan.vector_action(actions["action"]))
        reward = np.asarray(reward, dtype=np.float32).reshape(self.num_envs, 1)
        rec = self._vrecord(obs)
        if self.plan.transforms:
            first = self._first  # the envs that ended last step: their rows are reset observations
            for t in self.plan.transforms:
                reward, terminated, truncated = t.vstep(rec, reward, terminated, truncated, first)
            self._first = np.asarray(terminated, bool) | np.asarray(truncated, bool)
        return rec, reward, terminated, truncated

    def reset_some(self, mask):
        """Resets the envs where ``mask`` (bool ``[k]``) is set, for a vector env that does not
        autoreset (``DISABLED``), as TorchRL does: one ``reset(options={"reset_mask": mask})``;
        returns the observations (rows of the other envs are unspecified)."""
        if self.autoresets:
            raise RuntimeError("a NEXT_STEP vector env resets its envs itself")
        obs, _ = self.vec.reset(options={"reset_mask": np.asarray(mask, bool)})
        return self._vrecord(obs)

    def split(self):
        """The ``k`` sub-envs as adapters of one slot each (:class:`VectorSubEnvAdapter`), for a
        worker to step them as their actions arrive instead of in lockstep; ``None`` where their
        records could differ from this adapter's: transforms on top, frame skipping, a vector env
        that does not autoreset, or one that is not a ``SyncVectorEnv``."""
        import gymnasium as gym

        if (self.plan.transforms or self.plan.frame_skip != 1 or not self.autoresets
                or type(self.vec) is not gym.vector.SyncVectorEnv):
            return None
        shared = {"seed": self._first_seed, "open": self.num_envs}
        self._first_seed = None
        return [VectorSubEnvAdapter(self, j, shared) for j in range(self.num_envs)]


class VectorSubEnvAdapter:
    """Sub-env ``j`` of a ``SyncVectorEnv`` that TorchRL's ``GymEnv(env_id, num_envs=k)`` built,
    stepped on its own in one slot (:meth:`TorchRLGymVectorFastAdapter.split`).

    Its records are those of the vector adapter's row ``j`` (and so of ``GymEnv(env_id)``
    seeded ``seed + j``): the sub-env is stepped with the action ``SyncVectorEnv`` would pass it,
    a record is encoded as the vector adapter encodes its rows, the first reset follows TorchRL's
    ``set_seed`` of the vector env (done once, by the first sub-env reset) and every later reset
    is unseeded, as ``SyncVectorEnv``'s ``NEXT_STEP`` autoreset calls ``reset()``; the worker's
    own autoreset makes the same ``FIRST`` records the vector env would. The vector env is
    closed once, when its last sub-env's slot closes.
    """

    takes_numpy = True
    path = "torchrl-fast-split"
    env = None  # the slot's env is the vector env's row, not an env of its own (close() closes)
    _plan = None  # no episode plans (evaluate() hosts single envs)

    @staticmethod
    def as_numpy(value):
        """Record entries are numpy already."""
        return value

    def __init__(self, parent: TorchRLGymVectorFastAdapter, j: int, shared: dict):
        self.parent, self.j, self._shared = parent, j, shared
        self.gym = parent.vec.envs[j]
        self.plan = parent.plan
        self.obs_keys, self.action_keys = parent.obs_keys, parent.action_keys
        self._closed = False

    def fields(self):
        """The slot fields (those of one row of the vector env)."""
        return self.parent.fields()

    def specs(self):
        """The specs of one row of the vector env."""
        return self.parent.specs()

    def reset(self):
        """Resets the sub-env (after the vector env's seeding, the first time); returns its record."""
        seed = self._shared["seed"]
        if seed is not None:
            self._shared["seed"] = None
            self.parent.env.set_seed(seed)  # seeds every sub-env seed + j, as the vector adapter's reset
        obs, _ = self.gym.reset()
        return self.plan.record(obs)

    def step(self, actions):
        """Steps the sub-env with its action row; returns ``(record, reward, terminated, truncated)``."""
        obs, reward, terminated, truncated, _ = self.gym.step(self.plan.action(actions["action"]))
        return (self.plan.record(obs), np.asarray(reward, dtype=np.float32).reshape(1), bool(terminated),
                bool(truncated))

    def c_step(self, views):
        """What the worker's C pass loop needs to step this sub-env into the slot's rows ``views``
        (see :meth:`TorchRLGymFastAdapter.c_step`): ``(sub_env.step, action maker, observation
        row, None, None)`` where its record is the gymnasium observation itself (one ``Box`` of
        the spec's shape), else ``None``."""
        # split() took no transforms and no frame skipping: only the observation's layout decides
        if self.plan.dict_obs or tuple(self.gym.observation_space.shape) != self.plan.readers[0][3]:
            return None
        return self.gym.step, self.plan.action, views[0][1], None, None

    def step_into(self, actions, views):
        """:meth:`step` writing the record into ``views``; returns ``(reward, terminated, truncated)``."""
        rec, reward, terminated, truncated = self.step(actions)
        for key, view in views:
            copy_into(view, rec[key], key)
        return reward, terminated, truncated

    def random_action(self):
        """A random action row (the vector env's action spec, one row)."""
        return {k: v[0] for k, v in self.parent.random_action().items()}

    def close(self) -> None:
        """Closes the vector env when the last of its sub-env slots closes."""
        if self._closed:
            return
        self._closed = True
        self._shared["open"] -= 1
        if self._shared["open"] == 0:
            self.parent.close()


def log_choice(adapter, env, env_index, reason=None):
    """Logs (debug) the path ``adapter`` steps ``env`` on, and why when it is TorchRL's."""
    where, path = env_where(env_index), adapter.path
    if reason is None:
        log.debug("%s (%s): %s path", where, type(env).__name__, path)
    else:
        log.debug("%s (%s): TorchRL stepping (%s path): %s", where, type(env).__name__, path, reason)
