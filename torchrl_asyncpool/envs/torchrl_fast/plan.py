"""The fast path's plan of a TorchRL env (:func:`fast_plan`): its base env and transforms
checked once, the transform pipeline dry-run against the env's observation spec, and the
per-record work (decoding an action, encoding an observation) the adapters call."""
from __future__ import annotations

import numpy as np
import torch

from torchrl_asyncpool.envs.torchrl_fast.base_env import check_base, obs_readers, own_leaves, unwrap
from torchrl_asyncpool.envs.torchrl_fast.transforms import check_vector_transform, fast_transform
from torchrl_asyncpool.envs.torchrl_fast.unsupported import FastPathUnsupported, np_dtype

__all__ = ["FAST_PATH_ATTR", "fast_plan"]

#: Attribute a factory may set to ``False`` on the TorchRL env it returns to keep it on
#: TorchRL's own stepping (``TorchRLEnvAdapter``): for comparisons, or an env the fast path
#: would misjudge.
FAST_PATH_ATTR = "_torchrl_asyncpool_fast_path"


class _Plan:
    """What the fast path needs, read once from the TorchRL env."""

    def __init__(self, env, batched: bool):
        base, transforms = unwrap(env)
        self.base = base
        if batched:
            from torchrl.envs.transforms import VecGymEnvTransform

            vec = [t for t in transforms if type(t) is VecGymEnvTransform]
            # TorchRL adds VecGymEnvTransform to every autoresetting vector env; without it the env
            # does not autoreset (DISABLED) and TorchRL resets the ended envs with a reset mask
            self.autoresets = bool(vec)
            if not vec and transforms:
                raise FastPathUnsupported("transforms over a vector env that does not autoreset")
            if vec and (transforms[0] is not vec[0] or len(vec) != 1 or vec[0].native_autoreset):
                raise FastPathUnsupported("a vector GymEnv whose VecGymEnvTransform is not its first transform")
            transforms = transforms[1:]
            self._check_vector(base, self.autoresets)
            for t in transforms:
                check_vector_transform(t)
        self.action_kind, aspec = check_base(base, batched)
        self.action_dtype = np_dtype(aspec.dtype)
        self.readers = obs_readers(base, batched)
        self.frame_skip = base.wrapper_frame_skip
        self.dict_obs = self.readers[0][0] is not None
        dtypes = {key: (dtype, shape) for _, key, dtype, shape in self.readers}
        self.transforms = []
        for t in transforms:
            fast = fast_transform(t, dtypes, self.action_dtype)
            self.transforms.append(fast)
            dtypes = self._dry_run(dtypes)  # the entries the next transform sees
        self._check_layout(env, dtypes, batched)

    @staticmethod
    def _check_vector(base, autoresets: bool):
        import gymnasium as gym

        venv = base._env
        if not isinstance(venv, (gym.vector.SyncVectorEnv, gym.vector.AsyncVectorEnv)):
            raise FastPathUnsupported(f"vector env {type(venv).__name__} (not Sync/AsyncVectorEnv)")
        mode = venv.metadata.get("autoreset_mode", gym.vector.AutoresetMode.NEXT_STEP)
        want = gym.vector.AutoresetMode.NEXT_STEP if autoresets else gym.vector.AutoresetMode.DISABLED
        if getattr(mode, "value", mode) != want.value:
            raise FastPathUnsupported(f"vector env autoreset mode {mode}")

    def _dry_run(self, dtypes):
        """The entries (dtype, shape) the pipeline so far makes of zero observations, on reset
        and on a step (both must agree)."""
        rec = {k: np.zeros(shape, dtype) for k, (dtype, shape) in
               {r[1]: (r[2], r[3]) for r in self.readers}.items()}
        rec_step = dict(rec)
        state = [dict(vars(t)) for t in self.transforms]
        try:
            for t in self.transforms:
                t.reset(rec)
            reward = np.zeros(1, np.float32)
            for t in self.transforms:
                reward, _, _ = t.step(rec_step, reward, False, False)
        finally:
            for t, s in zip(self.transforms, state):  # the dry run leaves no per-episode state behind
                vars(t).update(s)
        out = {k: (np.asarray(v).dtype, np.shape(v)) for k, v in rec.items()}
        if out != {k: (np.asarray(v).dtype, np.shape(v)) for k, v in rec_step.items()}:
            raise FastPathUnsupported("the transforms make different entries on reset and on step")
        if np.asarray(reward).dtype != np.float32 or np.shape(reward) != (1,):
            raise FastPathUnsupported(f"the transforms make a reward {np.asarray(reward).dtype} {np.shape(reward)}")
        return out

    def _check_layout(self, env, dtypes, batched):
        spec = env.observation_spec
        lead = len(env.batch_size)
        want = {}
        for k in own_leaves(spec, batched):
            if not isinstance(k, str):
                raise FastPathUnsupported(f"nested observation key {k}")
            want[k] = (np_dtype(spec[k].dtype), tuple(spec[k].shape)[lead:])
        if want != dtypes:
            raise FastPathUnsupported(f"fast records {dtypes} differ from the env's observation spec {want}")
        self.obs_keys = list(want)

    # -- per record -------------------------------------------------------------------------------
    def action(self, a):
        """What ``gym_env.step`` gets for the slot's action row ``a`` (numpy), as ``GymWrapper``
        decodes it: a Python int for discrete actions, a fresh array otherwise."""
        kind = self.action_kind
        if kind == "onehot":
            return int(a.argmax(-1))  # OneHot.to_numpy: argmax of the row (first maximum)
        if kind == "categorical":
            return int(a)
        a = _copy_action(a)
        for t in reversed(self.transforms):  # TorchRL applies the inverses last to first
            a = t.action(a)
        return a

    def vector_action(self, a):
        """The ``[k]`` actions of a vector env, as TorchRL decodes a batch."""
        kind = self.action_kind
        if kind == "onehot":
            return a.argmax(-1)
        if kind == "categorical":
            return np.array(a)
        a = np.array(a)
        for t in reversed(self.transforms):
            a = t.action(a)
        return a

    def record(self, obs) -> dict:
        """The observation entries of a gymnasium observation, encoded as TorchRL encodes them
        (``spec.encode``: ``torch.as_tensor(value, dtype)`` reshaped to the spec's shape, e.g. a
        scalar ``Box`` to ``[1]``)."""
        if not self.dict_obs:
            _, key, dtype, shape = self.readers[0]
            return {key: np.asarray(obs, dtype=dtype).reshape(shape)}
        return {key: np.asarray(obs[gkey], dtype=dtype).reshape(shape) for gkey, key, dtype, shape in self.readers}

    def direct(self):
        """The single env's step straight into the slot's rows (:class:`_Direct`), or ``None``
        where the record needs the record path (:meth:`record` and each transform's ``step``).

        It applies when the record is the gymnasium observation (one ``Box`` of the spec's dtype
        and shape) cast to its row's dtype, plus at most a step count and a reward sum: the only
        transforms are ``DoubleToFloat`` of that observation (and the action), one ``StepCounter``
        and one ``RewardSum``. None of them reads another's output, so their order does not matter.
        """
        if self.dict_obs:
            return None
        space = self.base._env.observation_space
        _, key, dtype, shape = self.readers[0]
        if tuple(space.shape) != shape or np.dtype(space.dtype) != dtype:
            return None  # record() would cast or reshape before the transforms
        roles = {}
        for t in self.transforms:
            role = t.direct_role
            if role is None or (role != "cast" and (role in roles or t.key == key)):
                return None
            if role == "cast" and any(k != key or out != key for k, out in t.keys):
                return None
            roles.setdefault(role, []).append(t)
        counter, summer = roles.get("count", [None])[0], roles.get("sum", [None])[0]
        if counter is not None and summer is not None and counter.key == summer.key:
            return None
        cast = any(t.cast_action for t in roles.get("cast", []))
        return _Direct(self, key, counter, summer, cast)

    def plain(self) -> bool:
        """True when a record is the gymnasium observation itself (one ``Box``, no transforms,
        the spec's shape): the worker copies it straight into the slot."""
        if self.dict_obs or self.transforms or self.frame_skip != 1:
            return False
        space = self.base._env.observation_space
        return tuple(space.shape) == self.readers[0][3]


class _Direct:
    """What :meth:`_Plan.direct` found: the observation's entry, the ``StepCounter`` and the
    ``RewardSum`` (or ``None``) whose state the direct step advances, and how it decodes an
    action."""

    __slots__ = ("obs_key", "counter", "summer", "action")

    def __init__(self, plan, obs_key, counter, summer, cast_action):
        self.obs_key, self.counter, self.summer = obs_key, counter, summer
        if plan.action_kind != "box":
            self.action = plan.action  # a Python int, as GymWrapper decodes it
        else:  # one copy of the slot's row, cast to float64 where DoubleToFloat inverts the action
            self.action = _cast_action if cast_action else _copy_action


def _copy_action(a):
    # a copy: the env may keep it, the slot row is overwritten (a tensor through .numpy(): numpy 2's
    # np.array(tensor) warns that torch's __array__ takes no copy keyword)
    return a.numpy().copy() if isinstance(a, torch.Tensor) else np.array(a)


def _cast_action(a):
    return (a.numpy() if isinstance(a, torch.Tensor) else np.asarray(a)).astype(np.float64)


def fast_plan(env, batched: bool = False) -> _Plan:
    """Reads what stepping ``env`` without TorchRL needs; raises :class:`FastPathUnsupported`
    (the reason) when its records could differ from TorchRL's.

    Args:
        env: a TorchRL env (``GymEnv``, ``GymWrapper`` or a ``TransformedEnv`` of one).
        batched (bool, optional): ``env`` is ``GymEnv(..., num_envs=k)`` (a vector env).

    Returns:
        The plan (a private object) the fast adapters are built from.
    """
    if vars(env).get(FAST_PATH_ATTR, True) is False:
        raise FastPathUnsupported(f"{FAST_PATH_ATTR} is False on the env")
    return _Plan(env, batched)
