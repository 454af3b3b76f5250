"""Env adapters: how a worker steps each kind of env factory behind one interface.

Gymnasium envs and vector envs, EnvPool's gymnasium envs hosted as vector envs
(:mod:`~torchrl_asyncpool.envs.envpool_adapter`), TorchRL envs (with the fast path that steps a ``GymEnv`` or
``GymWrapper`` at gymnasium speed, :mod:`~torchrl_asyncpool.envs.torchrl_fast`), TorchRL batched
envs hosted in lockstep (:mod:`~torchrl_asyncpool.envs.torchrl_vector_hosting`), and the slot specs
read from an env (:mod:`~torchrl_asyncpool.envs.specs`). :func:`~torchrl_asyncpool.envs.adapters.make_adapter`
picks the adapter for a factory's env.
"""
