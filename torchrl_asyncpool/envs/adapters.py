"""Adapters that give every kind of env the same small interface inside a worker.

The worker loop only needs: the per-slot field specs (read once to size the arena), a
``reset`` and a ``step`` that return the observation entries, the reward and the two end
flags. Keeping this behind one interface is what lets a plain gymnasium env skip all
TensorDict work per step.
"""
from __future__ import annotations

from typing import Optional, Tuple


from torchrl.envs import EnvBase

from torchrl_asyncpool.envs import torchrl_vector_hosting
from torchrl_asyncpool.envs.env_attrs import env_where
from torchrl_asyncpool.envs.envpool_adapter import EnvPoolAsyncAdapter, EnvPoolVectorAdapter, is_envpool
from torchrl_asyncpool.envs.gymnasium_adapters import GymnasiumEnvAdapter, GymnasiumVectorAdapter
from torchrl_asyncpool.envs.torchrl_adapters import TorchRLBatchedAdapter, TorchRLEnvAdapter

# GymEnv(env_id, num_envs=k) as a factory: a worker (a daemonic process) builds its vector env
# synchronously (see torchrl_vector_hosting); installed here, the module every worker imports
torchrl_vector_hosting.install()

__all__ = ["is_vector_env", "make_adapter", "remote_listener", "adapter_path", "factory_path"]


def _torchrl_adapter(env, env_index):
    from torchrl_asyncpool.envs import torchrl_fast as fast

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
        fast.log_choice(adapter, env, env_index)
        return adapter
    if batched and _next_step_vector(env):
        what = _describe_vector(env)
        try:
            env.close()
        except Exception:  # noqa: BLE001 - the refusal below is the error to report
            pass
        raise TypeError(
            f"create_env_fn for {env_where(env_index)} returned {what}, which the pool cannot host: {reason}. "
            "TorchRL's "
            "own stepping of a gymnasium NEXT_STEP vector env does not give valid records at episode ends, so the "
            "pool hosts it only on its fast path (GymEnv(env_id, num_envs=k), optionally transformed by the "
            "transforms the fast path supports, see torchrl_asyncpool.envs.torchrl_fast). Pass one "
            "GymEnv(env_id) factory per env instead (any transforms), or a gymnasium vector env."
        )
    adapter = TorchRLBatchedAdapter(env, env_index) if batched else TorchRLEnvAdapter(env, env_index)
    adapter.fast_path_reason = reason
    fast.log_choice(adapter, env, env_index, reason)
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
    (:mod:`~torchrl_asyncpool.envs.torchrl_fast`) when its records are proven to be
    TorchRL's, else through TorchRL; the choice is logged at debug level
    (``torchrl_asyncpool.envs.torchrl_fast``) and kept in ``adapter.path`` and
    ``adapter.fast_path_reason``.
    """
    if isinstance(env, EnvBase):
        return _torchrl_adapter(env, env_index)
    try:
        import gymnasium as gym
    except ImportError:  # pragma: no cover - gymnasium is a dependency
        gym = None
    # an EnvPool env is a gymnasium.Env too (with one env's spaces but batched steps): the vector
    # env test comes first
    if is_envpool(env):
        if env.unwrapped.is_async:  # batch_size < num_envs
            return EnvPoolAsyncAdapter(env, env_index)
        return EnvPoolVectorAdapter(env, env_index)
    if gym is not None and isinstance(env, gym.vector.VectorEnv):
        return GymnasiumVectorAdapter(env, env_index)
    if gym is not None and isinstance(env, gym.Env):
        return GymnasiumEnvAdapter(env, env_index)
    hint = (" (EnvPool's dm_env API: use envpool.make_gymnasium instead)"
            if type(env).__module__.startswith("envpool") else "")
    raise TypeError(
        f"create_env_fn for {env_where(env_index)} returned {type(env).__name__}{hint}; expected a "
        "torchrl.envs.EnvBase, a gymnasium.Env, a gymnasium.vector.VectorEnv or an EnvPool env "
        "(envpool.make_gymnasium)."
    )


def adapter_path(adapter) -> str:
    """The name of the path an adapter steps its env on: ``"torchrl-fast"``,
    ``"torchrl-fast-vector"``, ``"torchrl"``, ``"torchrl-batched"``, ``"gymnasium"``,
    ``"gymnasium-vector"``, ``"envpool"`` (see :mod:`~torchrl_asyncpool.envs.torchrl_fast` and
    :mod:`~torchrl_asyncpool.envs.envpool_adapter`).

    Args:
        adapter: what :func:`make_adapter` returned.

    Returns:
        The adapter's ``path`` attribute (``"unknown"`` for an adapter without one).
    """
    return getattr(adapter, "path", "unknown")


def factory_path(create_env_fn, **kwargs) -> Tuple[str, Optional[str]]:
    """Builds one env with ``create_env_fn(**kwargs)`` as a pool worker would and says how a
    worker steps it: ``(path, reason)``, the path as :func:`adapter_path` names it and, for a
    TorchRL gym env kept on TorchRL's stepping, why (else ``None``). The env is closed again;
    a ``GymEnv(..., num_envs=k)`` is built with a ``SyncVectorEnv``, as in a worker.

    Args:
        create_env_fn (callable): an env factory, as given to ``AsyncEnvPool``.
        **kwargs: its keyword arguments.

    Returns:
        ``(path, reason)``.

    Examples:
        >>> import functools
        >>> from torchrl.envs import GymEnv, RenameTransform, TransformedEnv
        >>> from torchrl_asyncpool.envs.adapters import factory_path
        >>> factory_path(functools.partial(GymEnv, "CartPole-v1"))
        ('torchrl-fast', None)
        >>> factory_path(lambda: TransformedEnv(GymEnv("CartPole-v1"), RenameTransform(["observation"], ["obs"])))
        ('torchrl', 'transform RenameTransform')
    """
    from torchrl_asyncpool.envs.torchrl_vector_hosting import synchronous_vector_envs

    with synchronous_vector_envs():
        env = create_env_fn(**kwargs)
    adapter = make_adapter(env)
    try:
        return adapter_path(adapter), getattr(adapter, "fast_path_reason", None)
    finally:
        adapter.close()
