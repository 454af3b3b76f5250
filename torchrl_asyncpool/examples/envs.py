"""Env factories of the MuJoCo and Atari training scripts (``ppo_mujoco.py``, ``sac_mujoco.py``,
``impala_atari.py``), importable by the env workers (module-level functions).

Each env comes in two forms with the same observations and actions: a plain gymnasium env for
:class:`~torchrl_asyncpool.AsyncPoolCollector` (its workers step gymnasium envs on their fast
path, no TensorDict work per step) and a TorchRL env wrapping the same gymnasium env for the
scripts' ``--collector torchrl`` baselines (TorchRL's ``Collector``/``ParallelEnv``/
``MultiAsyncCollector``).

- MuJoCo (``HalfCheetah-v5``): observations cast to float32 (``DtypeObservation``; TorchRL's
  recipes append ``DoubleToFloat``), the env's own 1000-step time limit.
- Atari (``ALE/Pong-v5``): ``frameskip=1, repeat_action_probability=0.0`` in the ALE, then
  gymnasium's ``AtariPreprocessing(noop_max=30, frame_skip=4, screen_size=84,
  grayscale_obs=True)`` and ``FrameStackObservation(4)``: ``uint8`` observations of shape
  ``(4, 84, 84)``, one agent step = 4 emulator frames. Rewards are left unclipped (the learner
  clips them); no end-of-life signal.
"""
from __future__ import annotations

import warnings

import numpy as np

__all__ = ["make_mujoco_env", "make_torchrl_mujoco_env", "make_atari_env", "make_torchrl_atari_env"]


def make_mujoco_env(env_id: str = "HalfCheetah-v5"):
    """A gymnasium MuJoCo env with float32 observations."""
    import gymnasium

    env = gymnasium.make(env_id)
    with warnings.catch_warnings():
        # the float64 bounds of the space are cast to float32 (MuJoCo's are +-inf, which float32
        # holds exactly): gymnasium warns twice for every env built, i.e. every worker and restart
        warnings.filterwarnings("ignore", message=".*precision lowered by casting to float32", category=UserWarning)
        return gymnasium.wrappers.DtypeObservation(env, np.float32)


def make_torchrl_mujoco_env(env_id: str = "HalfCheetah-v5"):
    """The same env as a TorchRL ``GymWrapper`` (for TorchRL's own collectors)."""
    from torchrl.envs import GymWrapper

    return GymWrapper(make_mujoco_env(env_id))


def make_atari_env(env_id: str = "ALE/Pong-v5"):
    """A gymnasium Atari env, preprocessed as in the DQN/IMPALA papers: ``(4, 84, 84)`` uint8."""
    import ale_py
    import gymnasium
    from gymnasium.wrappers import AtariPreprocessing, FrameStackObservation

    gymnasium.register_envs(ale_py)
    env = gymnasium.make(env_id, frameskip=1, repeat_action_probability=0.0)
    env = AtariPreprocessing(env, noop_max=30, frame_skip=4, screen_size=84, grayscale_obs=True)
    return FrameStackObservation(env, 4)


def make_torchrl_atari_env(env_id: str = "ALE/Pong-v5"):
    """The same env as a TorchRL ``GymWrapper`` with integer (categorical) actions."""
    from torchrl.envs import GymWrapper

    return GymWrapper(make_atari_env(env_id), categorical_action_encoding=True)
