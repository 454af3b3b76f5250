"""What to tell a user whose policy and env disagree on the float dtype.

The most common first failure of a MuJoCo run: gymnasium's MuJoCo envs observe float64, a
network built with torch's default dtype holds float32 parameters, and the policy's first call
fails inside ``F.linear`` with ``mat1 and mat2 must have the same dtype``, which names neither
the env nor the fix. Every start-up check that runs the policy on a record of the env's layout
(the collector's constructor, the inference server's dry run, ``torchrl-asyncpool eval
--validate-only``) adds :func:`dtype_mismatch_hint` to the error it raises.
"""
from __future__ import annotations

from typing import Mapping

import torch

from torchrl_asyncpool.exchange.arena import as_key, key_repr

__all__ = ["dtype_mismatch_hint"]


def dtype_mismatch_hint(input_dtypes: Mapping, policy, *, cast_policy: bool = True) -> str:
    """A sentence naming the entries, both dtypes and the fixes when some float entries of
    the records differ from the policy's float parameters; ``""`` when they agree, or when
    either side has no float (a policy without parameters, integer pixels).

    Args:
        input_dtypes (mapping): ``{key: torch.dtype}`` of the entries the policy is handed.
        policy: the policy; only an ``nn.Module``'s parameters are read (all of one float
            dtype, else no hint).

    Keyword Args:
        cast_policy (bool): also offer casting the policy to the observations' dtype; right where
            its actions are then cast to the env's dtypes (the collector does), wrong where the
            policy must write them in those dtypes itself (a policy served by
            :class:`~torchrl_asyncpool.InferenceServer`). Defaults to ``True``.

    Examples:
        >>> import torch
        >>> from torchrl_asyncpool.inference.dtype_hint import dtype_mismatch_hint
        >>> record = {"observation": torch.float64, "reward": torch.float32, "done": torch.bool}
        >>> hint = dtype_mismatch_hint(record, torch.nn.Linear(17, 6))
        >>> print(hint[:hint.index(":")])
        The env's observations are float64 ('observation') but the policy's parameters are float32
        >>> "DtypeObservation(env, numpy.float32)" in hint, "policy.to(torch.float64)" in hint
        (True, True)
        >>> dtype_mismatch_hint({"observation": torch.float32}, torch.nn.Linear(17, 6))
        ''
    """
    params = ({p.dtype for p in policy.parameters() if p.dtype.is_floating_point}
              if isinstance(policy, torch.nn.Module) else set())
    if len(params) != 1:
        return ""
    want = next(iter(params))
    odd = {k: d for k, d in input_dtypes.items() if d.is_floating_point and d != want}
    if not odd:
        return ""
    have = sorted({_name(d) for d in odd.values()})
    keys = ", ".join(repr(key_repr(as_key(k))) for k in odd)
    fix = (f"cast the observations in the env factory (gymnasium.wrappers.DtypeObservation(env, numpy.{_name(want)}), "
           f"or TorchRL's DoubleToFloat transform)")
    if cast_policy:
        fix += f", or the policy to the observations' dtype (policy.to(torch.{have[0]}))"
    return (f"The env's observations are {', '.join(have)} ({keys}) but the policy's parameters are "
            f"{_name(want)}: {fix}.")


def _name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")
