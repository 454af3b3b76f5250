"""The TorchRL specs of one pool slot, read from the spec env once at start-up.

A pool lays out its slots from ``{key: (shape, dtype)}`` fields; TorchRL code also wants the
specs (bounds, number of categories, one-hot or categorical) to build policies, samplers and
losses: ``pool.action_spec.rand()``, ``pool.observation_spec["pixels"].shape``. They come
from the env the pool already builds to read its fields: a TorchRL env's own specs (without
their batch dimension), or a gymnasium env's spaces through TorchRL's own conversion, so that
``AsyncEnvPool`` and ``GymEnv`` describe the same env the same way (categorical actions: the
slot holds an integer, not a one-hot vector). Every spec is checked against the slot's field;
where they differ (an env that declares one thing and returns another is laid out by what it
returns), the spec is an unbounded one of the field's shape and dtype, with a warning.
"""
from __future__ import annotations

import warnings
from typing import Dict, Mapping, Tuple

import torch
from torchrl.data import Categorical, Composite, Unbounded

__all__ = ["SPEC_GROUPS", "slot_specs", "gymnasium_specs", "torchrl_specs", "batched_specs"]

#: the four specs a slot has, under the names TorchRL's ``EnvBase`` gives them
SPEC_GROUPS = ("full_observation_spec", "full_action_spec", "full_reward_spec", "full_done_spec")
_END_FLAGS = ("done", "terminated", "truncated")


def slot_specs(adapter) -> Dict[str, Composite]:
    """``adapter.specs()``; if the env's specs cannot be read or converted, unbounded specs of
    the slot's fields, with a warning (the pool runs on its fields, not on the specs)."""
    try:
        return adapter.specs()
    except Exception as exc:  # noqa: BLE001 - the specs describe the env; their failure must not stop it
        warnings.warn(
            f"could not read the env's TorchRL specs ({type(exc).__name__}: {exc}); the pool's specs are "
            "Unbounded specs of its slot fields.",
            RuntimeWarning,
            stacklevel=3,
        )
    request, response = adapter.fields()
    groups = {"full_action_spec": [(k, response[k]) for k in adapter.action_keys],
              "full_observation_spec": [(k, request[k]) for k in adapter.obs_keys],
              "full_reward_spec": [("reward", request["reward"])],
              "full_done_spec": [(k, request[k]) for k in _END_FLAGS]}
    specs = {}
    for name, leaves in groups.items():
        specs[name] = Composite(shape=())
        for k, (shape, dtype) in leaves:
            boolean = dtype == torch.bool
            specs[name][k] = Categorical(2, shape, dtype=dtype) if boolean else Unbounded(shape, dtype=dtype)
    return specs


def torchrl_specs(env, batch_dims: int, obs_keys, reward_key, action_keys, fields) -> Dict[str, Composite]:
    """The slot specs of a TorchRL env (``batch_dims`` leading dimensions dropped)."""
    index = (0,) * batch_dims

    def unbatched(spec, keys):
        spec = spec[index] if batch_dims else spec.clone()
        out = Composite(shape=())
        for k in keys:  # keys may be nested tuples, which the constructor does not take
            out[k] = spec[k]
        return out

    done_spec = env.full_done_spec
    done_spec = done_spec[index] if batch_dims else done_spec
    done = Composite(shape=())
    for k in _END_FLAGS:  # the pool always delivers all three (TorchRL envs may declare only "done")
        done[k] = done_spec[k].clone() if k in done_spec.keys() else Categorical(2, fields[0][k][0], dtype=torch.bool)
    specs = {
        "full_observation_spec": unbatched(env.observation_spec, obs_keys),
        "full_action_spec": unbatched(env.full_action_spec, action_keys),
        "full_reward_spec": Composite({"reward": unbatched(env.full_reward_spec, [reward_key])[reward_key]}, shape=()),
        "full_done_spec": done,
    }
    return _checked(specs, fields)


def gymnasium_specs(observation_spaces: Mapping, action_space, fields) -> Dict[str, Composite]:
    """The slot specs of a gymnasium env, as TorchRL's ``GymEnv`` converts its spaces (with
    ``categorical_action_encoding=True``: a ``Discrete`` action is an integer)."""
    import gymnasium as gym
    from torchrl.envs.libs.gym import _gym_to_torchrl_spec_transform

    def convert(space, **kwargs):
        if isinstance(space, gym.spaces.Discrete):  # the slot holds an int64 whatever the space's dtype
            return Categorical(int(space.n), shape=(), dtype=torch.int64)
        spec = _gym_to_torchrl_spec_transform(space, **kwargs)
        if isinstance(space, gym.spaces.Box) and space.shape == () and spec.shape == (1,):
            spec = spec.squeeze(-1)  # TorchRL makes a scalar Box [1]; the slot holds the scalar
        return spec

    request, response = fields
    specs = {
        "full_observation_spec": Composite(
            {k: convert(sp, categorical_action_encoding=True) for k, sp in observation_spaces.items()}, shape=()
        ),
        "full_action_spec": Composite({"action": convert(action_space, categorical_action_encoding=True)}, shape=()),
        "full_reward_spec": Composite({"reward": Unbounded(*request["reward"][:1], dtype=request["reward"][1])},
                                      shape=()),
        "full_done_spec": Composite(
            {k: Categorical(2, request[k][0], dtype=torch.bool) for k in _END_FLAGS}, shape=()
        ),
    }
    return _checked(specs, fields)


def _checked(specs: Dict[str, Composite], fields: Tuple[Mapping, Mapping]) -> Dict[str, Composite]:
    """``specs`` with each leaf that disagrees with its slot field replaced by an unbounded spec
    of the field (the slot holds what the env returns, so that is what the spec must say)."""
    request, response = fields
    for group, spec in specs.items():
        where = response if group == "full_action_spec" else request
        for key in list(spec.keys(True, True)):
            want = where.get(key)
            if want is None:
                continue
            leaf = spec[key]
            shape, dtype = tuple(want[0]), want[1]
            if tuple(leaf.shape) != shape or leaf.dtype != dtype:
                warnings.warn(
                    f"the env's {group} declares {key!r} as shape {tuple(leaf.shape)} {leaf.dtype}, but its slot "
                    f"holds {shape} {dtype}: the pool's spec is Unbounded({shape}, {dtype}).",
                    RuntimeWarning,
                    stacklevel=4,
                )
                spec[key] = Unbounded(shape, dtype=dtype)
    return specs


def batched_specs(specs: Mapping[str, Composite], num_envs: int) -> Dict[str, Composite]:
    """Slot specs expanded to the pool's batch size ``[num_envs]``, on the CPU: the records are
    views of the CPU arena, wherever the env keeps its specs (or its tensors)."""
    out = {}
    for name, spec in specs.items():
        spec = spec.clone()
        for key in list(spec.keys(True, True)):  # the leaves: the groups keep TorchRL's device=None
            if spec[key].device != torch.device("cpu"):
                spec[key] = spec[key].to("cpu")
        out[name] = spec.expand(num_envs)
    return out
