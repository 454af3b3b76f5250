"""What the TorchRL fast path reads and checks of the base env under the transforms: a
``GymEnv``/``GymWrapper`` over a gymnasium env (:func:`check_base`: device, readers, reward,
frame skip, how the action is decoded), the transforms above it in TorchRL's order
(:func:`unwrap`) and how each observation entry is encoded (:func:`obs_readers`)."""
from __future__ import annotations

from typing import List

import numpy as np
import torch

from torchrl_asyncpool.envs.torchrl_fast.unsupported import FastPathUnsupported, np_dtype

__all__ = ["unwrap", "check_base", "obs_readers", "own_leaves"]


def unwrap(env):
    """``(base env, [transforms in the order TorchRL applies them])`` of a TorchRL env.

    Args:
        env: a TorchRL env, possibly a ``TransformedEnv`` (of ``TransformedEnv`` ...).

    Examples:
        >>> from torchrl.envs import GymEnv, StepCounter, TransformedEnv
        >>> from torchrl_asyncpool.envs.torchrl_fast.base_env import unwrap
        >>> base, transforms = unwrap(TransformedEnv(GymEnv("CartPole-v1"), StepCounter()))
        >>> type(base).__name__, [type(t).__name__ for t in transforms]
        ('GymEnv', ['StepCounter'])
    """
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


def check_base(base, batched: bool):
    """Checks that the fast path reproduces ``base``'s records (raises
    :class:`FastPathUnsupported` with the reason if not).

    Args:
        base: the ``GymEnv``/``GymWrapper`` under the transforms (:func:`unwrap`).
        batched (bool): ``base`` wraps a gymnasium vector env.

    Returns:
        ``(action kind, action spec)``: ``"onehot"``, ``"categorical"`` or ``"box"``.
    """
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
    # (whose entries the fast path leaves out, see own_leaves); any other reader adds entries
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


def obs_readers(base, batched: bool):
    """``[(gym key or None, record key, np dtype, shape)]`` for the gymnasium observation
    (``None``: the whole non-dict observation), as ``GymLikeEnv.read_obs`` encodes it.

    Args:
        base: the ``GymEnv``/``GymWrapper`` under the transforms.
        batched (bool): ``base`` wraps a gymnasium vector env (shapes are one env's).
    """
    import gymnasium as gym

    space = base._env.single_observation_space if batched else base._env.observation_space
    spec = base.observation_spec
    lead = len(base.batch_size)
    leaves = own_leaves(spec, batched)

    def reader(gkey, key, sub):
        if not isinstance(sub, gym.spaces.Box):
            raise FastPathUnsupported(f"observation space {type(sub).__name__} (TorchRL encodes it, e.g. one-hot)")
        leaf = spec[key]
        dtype = np_dtype(leaf.dtype)
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


def own_leaves(spec, batched: bool) -> list:
    """The observation spec's leaves, less (for a vector env) the ``("final", ...)`` entries that
    TorchRL's terminal-observation info reader declares: with NEXT_STEP autoreset gymnasium puts
    no final observation in the info, and the pool's terminal record carries the observation."""
    leaves = list(spec.keys(True, True))
    if batched:
        leaves = [k for k in leaves if not (isinstance(k, tuple) and k[0] == "final")]
    return leaves
