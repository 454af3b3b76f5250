"""The fast path for TorchRL gym envs: a worker steps the gymnasium env inside them directly.

A factory that returns TorchRL's ``GymEnv``/``GymWrapper`` (or a ``TransformedEnv`` of one)
costs a worker ~13x the gymnasium step it wraps when stepped through TorchRL (``_step``
builds TensorDicts and encodes through the specs on every call). The records of such an env
are a pure function of the gymnasium env's outputs and a little per-episode state, so this
module recomputes them with numpy: the obs entries encoded as TorchRL encodes them (its spec's
dtype and shape), the reward as a ``float32 [1]``, the actions decoded as ``GymWrapper``
decodes them (one-hot -> ``argmax``, categorical -> ``int``, ``Box`` -> array), and each
supported transform applied in the order TorchRL applies it.

What is supported (everything else falls back to :class:`TorchRLEnvAdapter`, TorchRL's own
stepping, with the reason in the debug log and in ``adapter.fast_path_reason``):

* ``GymEnv``/``GymWrapper`` (the classes themselves, not subclasses, which may override
  ``_step``) over a ``gymnasium`` env, on the CPU, without info readers,
  a ``reward_space`` or spec checks (``CHECK_SPEC_ENCODE``); ``Box`` observations or a flat
  ``Dict`` of ``Box`` (``Discrete`` observations become one-hot vectors in TorchRL: not
  reproduced); ``Discrete`` (one-hot or categorical) or ``Box`` actions; any ``frame_skip``.
  ``from_pixels`` envs are stepped through the gymnasium wrapper that renders them
  (``AddRenderObservation``, or the env's own ``"pixels"`` entry); TorchRL's legacy
  ``GymPixelObservationWrapper`` (gymnasium without ``render_mode``) falls back.
* Transforms, each only with the arguments whose arithmetic is reproduced exactly:
  ``StepCounter`` (any ``max_steps``), ``RewardSum`` (the env's reward, summed into an
  observation entry), ``RewardScaling`` and ``ObservationNorm`` (``loc``/``scale`` of the
  entry's dtype, so numpy computes in the dtype torch computes in: torch's 0-d tensors do not
  promote, numpy's do), ``DoubleToFloat`` (observation entries and the action),
  ``CatTensors`` (inputs of one dtype) and ``UnsqueezeTransform`` (observation entries).
  Transforms with learned or shared state (``VecNorm``), with an inverse on anything but the
  action, or that need TensorDicts (``TensorDictPrimer`` specs, policies as transforms) fall back.
* ``GymEnv(env_id, num_envs=k)`` (optionally transformed, as above except
  ``StepCounter(max_steps=...)``): ``k`` slots of one worker stepped in lockstep, sub-env ``j``
  with the records of ``GymEnv(env_id)`` seeded ``seed + j``
  (:class:`TorchRLGymVectorFastAdapter`). TorchRL's own stepping cannot host it (see there), so
  a ``num_envs`` env this module refuses is an error, not a fallback. ``GymWrapper`` over a
  vector env that does not autoreset (``DISABLED``, no transforms) is stepped directly too, its
  ended envs reset with a reset mask as TorchRL does; one that autoresets in ``SAME_STEP`` mode
  falls back to TorchRL's batched stepping.

Which path a slot takes: ``adapter.path`` (:func:`adapter_path`) and a debug log line of the
``torchrl_asyncpool.envs.torchrl_fast`` logger when the adapter is built (in the pool's
process for the env it reads its specs from, and in each worker). An env that must stay on
TorchRL's stepping: set :data:`FAST_PATH_ATTR` to ``False`` on it.

Before an env is put on the fast path its transform pipeline is dry-run on zero observations
and must produce exactly the keys, shapes and dtypes of the TorchRL env's observation spec (the
slot layout). Seeding goes through TorchRL's own ``set_seed`` (once per seed), so the random
streams are TorchRL's. ``test/test_torchrl_envs.py`` runs TorchRL's env and the fast path from
the same seeds with the same actions and compares every record.
"""
from __future__ import annotations

import logging
from typing import Dict, List, Optional

import numpy as np
import torch

from torchrl_asyncpool.exchange.native import copy_into
from torchrl_asyncpool.envs.env_attrs import env_where
from torchrl_asyncpool.envs.torchrl_adapters import TorchRLBatchedAdapter, TorchRLEnvAdapter

__all__ = ["FAST_PATH_ATTR", "FastPathUnsupported", "fast_plan", "TorchRLGymFastAdapter",
           "TorchRLGymVectorFastAdapter", "VectorSubEnvAdapter"]

log = logging.getLogger(__name__)

#: Attribute a factory may set to ``False`` on the TorchRL env it returns to keep it on
#: TorchRL's own stepping (``TorchRLEnvAdapter``): for comparisons, or an env this module
#: would misjudge.
FAST_PATH_ATTR = "_torchrl_asyncpool_fast_path"


class FastPathUnsupported(Exception):
    """Why an env stays on TorchRL's own stepping (the message is the reason)."""


def _np_dtype(dtype: torch.dtype) -> np.dtype:
    return torch.empty((), dtype=dtype).numpy().dtype


# -- the base env ---------------------------------------------------------------------------------
def _unwrap(env):
    """``(base env, [transforms in the order TorchRL applies them])``."""
    from torchrl.envs import TransformedEnv
    from torchrl.envs.transforms import Compose

    transforms: List = []
    while isinstance(env, TransformedEnv):
        t = env.transform
        own = list(t) if type(t) is Compose else [t]
        for sub in own:
            if type(sub) is Compose:  # not unrolled here: such an env stays on TorchRL's stepping
                raise FastPathUnsupported("nested Compose")
        transforms = own + transforms  # the inner env's transforms run first
        env = env.base_env
    return env, transforms


def _check_base(base, batched: bool):
    import gymnasium as gym
    from torchrl.data import OneHot, Categorical, Bounded, Unbounded
    from torchrl.data import tensor_specs
    from torchrl.envs import GymEnv, GymWrapper
    from torchrl.envs.gym_like import GymLikeEnv

    if type(base) not in (GymEnv, GymWrapper):
        raise FastPathUnsupported(f"base env is {type(base).__name__}, not GymEnv/GymWrapper")
    if base.get_library_name(base._env) != "gymnasium":
        raise FastPathUnsupported("the wrapped env is not a gymnasium env")
    if getattr(base, "from_pixels", False) and _legacy_pixel_wrapper(base._env):
        # from_pixels otherwise only means pixels inside ``_env`` (the env's own "pixels" entry,
        # or gymnasium's AddRenderObservation wrapper), which the fast path steps through as is
        raise FastPathUnsupported("from_pixels=True through TorchRL's legacy pixel wrapper")
    from torchrl.envs.libs.gym import terminal_obs_reader

    # a vector env's only reader may be the terminal-observation one TorchRL registers itself
    # (whose entries the fast path leaves out, see _own_leaves); any other reader adds entries
    readers = list(base.info_dict_reader or [])
    if any(not (batched and type(r) is terminal_obs_reader) for r in readers):
        raise FastPathUnsupported("info dict readers")
    if base.device not in (None, torch.device("cpu")):
        raise FastPathUnsupported(f"env device {base.device}")
    if not base._convert_actions_to_numpy:
        raise FastPathUnsupported("convert_actions_to_numpy=False")
    if getattr(tensor_specs, "_CHECK_SPEC_ENCODE", False):
        raise FastPathUnsupported("CHECK_SPEC_ENCODE is set (TorchRL checks every value against its spec)")
    for name in ("read_obs", "read_reward", "read_action", "read_done", "_step", "_reset", "_output_transform",
                 "_reset_output_transform"):
        own = vars(base).get(name)
        if own is not None and not _is_known_instance_method(base, name, own):
            raise FastPathUnsupported(f"{name} replaced on the instance")
    if type(base).read_obs is not GymLikeEnv.read_obs or type(base).read_reward is not GymLikeEnv.read_reward:
        raise FastPathUnsupported("read_obs/read_reward overridden")
    if base._reward_space(base._env) is not None:
        raise FastPathUnsupported("the env has a reward_space")
    if len(base.reward_keys) != 1 or base.reward_key != "reward":
        raise FastPathUnsupported("reward keys other than 'reward'")
    rspec = base.full_reward_spec["reward"]
    lead = tuple(base.batch_size)
    if not isinstance(rspec, Unbounded) or tuple(rspec.shape) != lead + (1,) or rspec.dtype != torch.float32:
        raise FastPathUnsupported(f"reward spec {rspec}")
    if not isinstance(base.wrapper_frame_skip, int) or base.wrapper_frame_skip < 1:
        raise FastPathUnsupported("frame skip")
    if batched and base.wrapper_frame_skip != 1:
        raise FastPathUnsupported("frame skip on a vector env")
    if list(base.action_keys) != ["action"]:
        raise FastPathUnsupported(f"action keys {base.action_keys}")
    aspec = base.full_action_spec["action"]
    space = base._env.single_action_space if batched else base._env.action_space
    if isinstance(space, gym.spaces.Discrete):
        if type(aspec) is OneHot and not aspec.use_register:
            action = "onehot"
        elif type(aspec) is Categorical and not getattr(aspec, "use_register", False):
            action = "categorical"
        else:
            raise FastPathUnsupported(f"discrete action spec {type(aspec).__name__}")
        if int(space.start) != 0:
            raise FastPathUnsupported("Discrete action space with start != 0")
    elif isinstance(space, gym.spaces.Box):
        if not isinstance(aspec, (Bounded, Unbounded)):
            raise FastPathUnsupported(f"Box action spec {type(aspec).__name__}")
        action = "box"
    else:
        raise FastPathUnsupported(f"action space {type(space).__name__}")
    return action, aspec


def _legacy_pixel_wrapper(env) -> bool:
    from torchrl.envs.libs.utils import GymPixelObservationWrapper

    while env is not None:
        if isinstance(env, GymPixelObservationWrapper):
            return True
        env = getattr(env, "env", None)
    return False


def _is_known_instance_method(base, name, own) -> bool:
    # GymWrapper._post_init binds the gym-version specific implementations onto the instance
    # (``_output_transform``/``_reset_output_transform``), and fast_encoding() binds the memoized
    # readers: both compute what the class methods compute.
    from torchrl.envs.gym_like import GymLikeEnv

    func = getattr(own, "__func__", None)
    if name in ("_output_transform", "_reset_output_transform"):
        return getattr(own, "__self__", None) is base
    if name == "read_obs":
        return func is GymLikeEnv._read_obs_memo or func is GymLikeEnv._read_obs_eager
    if name == "read_reward":
        return func is GymLikeEnv._read_reward_memo or func is GymLikeEnv._read_reward_eager
    return False


def _obs_readers(base, batched: bool):
    """``[(gym key or None, record key, np dtype, shape)]`` for the gymnasium observation
    (``None``: the whole non-dict observation), as ``GymLikeEnv.read_obs`` encodes it."""
    import gymnasium as gym

    space = base._env.single_observation_space if batched else base._env.observation_space
    spec = base.observation_spec
    lead = len(base.batch_size)
    leaves = _own_leaves(spec, batched)

    def reader(gkey, key, sub):
        if not isinstance(sub, gym.spaces.Box):
            raise FastPathUnsupported(f"observation space {type(sub).__name__} (TorchRL encodes it, e.g. one-hot)")
        leaf = spec[key]
        dtype = _np_dtype(leaf.dtype)
        shape = tuple(leaf.shape)[lead:]
        if int(np.prod(sub.shape)) != int(np.prod(shape)):
            raise FastPathUnsupported(f"observation {key!r}: space shape {sub.shape} != spec shape {shape}")
        if np.dtype(sub.dtype) != dtype and not (np.issubdtype(sub.dtype, np.floating)
                                               and np.issubdtype(dtype, np.floating)):
            raise FastPathUnsupported(f"observation {key!r}: {sub.dtype} cast to {dtype}")
        return gkey, key, dtype, shape

    if isinstance(space, gym.spaces.Dict):
        readers = []
        for gkey, sub in space.spaces.items():
            key = "observation" if gkey == "state" and "observation" not in space.spaces else gkey
            if key not in leaves:
                raise FastPathUnsupported(f"observation {gkey!r} not in the spec")
            readers.append(reader(gkey, key, sub))
        if {r[1] for r in readers} != set(leaves):
            raise FastPathUnsupported("observation spec keys differ from the Dict space")
        return readers
    if len(leaves) != 1 or not isinstance(leaves[0], str):
        raise FastPathUnsupported(f"observation spec keys {leaves}")
    return [reader(None, leaves[0], space)]


def _own_leaves(spec, batched: bool) -> list:
    """The observation spec's leaves, less (for a vector env) the ``("final", ...)`` entries that
    TorchRL's terminal-observation info reader declares: with NEXT_STEP autoreset gymnasium puts
    no final observation in the info, and the pool's terminal record carries the observation."""
    leaves = list(spec.keys(True, True))
    if batched:
        leaves = [k for k in leaves if not (isinstance(k, tuple) and k[0] == "final")]
    return leaves


# -- transforms --------------------------------------------------------------------------------------
class _Fast:
    """A transform on numpy records: ``reset(rec)`` and ``step(rec, reward, term, trunc)``."""

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
        self.n += 1
        rec[self.key] = np.array([self.n], np.int64)
        if self.max_steps is not None and self.n >= self.max_steps:
            truncated = True  # StepCounter ORs it into truncated (and done)
        return reward, terminated, truncated

    def vreset(self, rec, k):
        self.n = np.zeros((k, 1), np.int64)
        rec[self.key] = self.n

    def vstep(self, rec, reward, terminated, truncated, first):
        self.n = np.where(first[:, None], 0, self.n + 1)
        rec[self.key] = self.n
        return reward, terminated, truncated


class _RewardSum(_Fast):
    def __init__(self, t):
        _only_root_reset(t)
        if t.reward_spec:
            raise FastPathUnsupported("RewardSum(reward_spec=True)")
        if list(t.in_keys) != ["reward"] or len(t.out_keys) != 1 or not isinstance(t.out_keys[0], str):
            raise FastPathUnsupported(f"RewardSum keys {t.in_keys} -> {t.out_keys}")
        self.key = t.out_keys[0]
        self.total = np.zeros(1, np.float32)

    def reset(self, rec):
        self.total = np.zeros(1, np.float32)
        rec[self.key] = self.total

    def step(self, rec, reward, terminated, truncated):
        self.total = self.total + reward  # float32 [1] + float32 [1], as torch adds them
        rec[self.key] = self.total
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
    if _np_dtype(loc.dtype) != dtype or _np_dtype(scale.dtype) != dtype:
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


def _check_vector_transform(t):
    """The transforms a vector env's records take row by row (see ``_Fast.vstep``)."""
    from torchrl.envs.transforms import CatTensors, StepCounter

    if type(t) is StepCounter and t.max_steps is not None:
        # its truncation would need the vector env to reset that env, which it does not know of
        raise FastPathUnsupported("StepCounter(max_steps=...) over a vector env (pass max_episode_steps to GymEnv)")
    if type(t) is CatTensors and t.dim >= 0:
        raise FastPathUnsupported("CatTensors with a non-negative dim over a vector env")


def _fast_transform(t, dtypes, action_dtype):
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


# -- the plan ------------------------------------------------------------------------------------------
class _Plan:
    """What the fast path needs, read once from the TorchRL env."""

    def __init__(self, env, batched: bool):
        base, transforms = _unwrap(env)
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
                _check_vector_transform(t)
        self.action_kind, aspec = _check_base(base, batched)
        self.action_dtype = _np_dtype(aspec.dtype)
        self.readers = _obs_readers(base, batched)
        self.frame_skip = base.wrapper_frame_skip
        self.dict_obs = self.readers[0][0] is not None
        dtypes = {key: (dtype, shape) for _, key, dtype, shape in self.readers}
        self.transforms = []
        for t in transforms:
            fast = _fast_transform(t, dtypes, self.action_dtype)
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
        for k in _own_leaves(spec, batched):
            if not isinstance(k, str):
                raise FastPathUnsupported(f"nested observation key {k}")
            want[k] = (_np_dtype(spec[k].dtype), tuple(spec[k].shape)[lead:])
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
        # a copy: the env may keep it, the slot row is overwritten (a tensor through .numpy(): numpy 2's
        # np.array(tensor) warns that torch's __array__ takes no copy keyword)
        a = a.numpy().copy() if isinstance(a, torch.Tensor) else np.array(a)
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

    def plain(self) -> bool:
        """True when a record is the gymnasium observation itself (one ``Box``, no transforms,
        the spec's shape): the worker copies it straight into the slot."""
        if self.dict_obs or self.transforms or self.frame_skip != 1:
            return False
        space = self.base._env.observation_space
        return tuple(space.shape) == self.readers[0][3]


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


# -- adapters ------------------------------------------------------------------------------------------
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
        self._rec = None
        # the worker's _Slot reads ``self.step`` once: keep the planned variant when there is a plan
        if self._plan is not None:
            self.step = self._planned_step
            self.step_into = self._planned_step_into
        elif plan.plain():
            self.step_into = self._plain_step_into

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
        self._rec = rec
        return rec

    def _gym_step(self, actions):
        plan = self.plan
        a = plan.action(actions["action"])
        if plan.frame_skip == 1:
            obs, reward, terminated, truncated, _ = self.gym.step(a)
        else:  # GymLikeEnv._step: repeat, sum the rewards, stop at the first end
            reward = 0
            for _ in range(plan.frame_skip):
                obs, r, terminated, truncated, _ = self.gym.step(a)
                if r is not None:
                    reward = reward + r
                if terminated or truncated:
                    break
        reward = np.asarray(reward, dtype=np.float32).reshape(1)  # reward_spec.encode
        rec = plan.record(obs)
        terminated, truncated = bool(terminated), bool(truncated)
        for t in self.transforms:
            reward, terminated, truncated = t.step(rec, reward, terminated, truncated)
        self._rec = rec
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
            copy_into(view, rec[key])
        return reward, terminated, truncated

    def _planned_step_into(self, actions, views):
        rec, reward, terminated, truncated = self._planned_step(actions)
        for key, view in views:
            copy_into(view, rec[key])
        return reward, terminated, truncated

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

    def step_into(self, actions, views):
        """:meth:`step` writing the record into ``views``; returns ``(reward, terminated, truncated)``."""
        rec, reward, terminated, truncated = self.step(actions)
        for key, view in views:
            copy_into(view, rec[key])
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


def _log_choice(adapter, env, env_index, reason=None):
    where, path = env_where(env_index), adapter.path
    if reason is None:
        log.debug("%s (%s): %s path", where, type(env).__name__, path)
    else:
        log.debug("%s (%s): TorchRL stepping (%s path): %s", where, type(env).__name__, path, reason)
