"""Policies that answer the correctness oracle (:class:`~torchrl_asyncpool.testing.OracleEnv`):
the action is a function of the record's tag, so a test can check every action it sees.

They are importable (so they pickle by reference into an inference server process).
"""
from __future__ import annotations

from typing import Optional

import torch
from tensordict import TensorDictBase
from torch import nn

from torchrl_asyncpool.testing.oracle_env import oracle_action

__all__ = ["OracleTagPolicy", "RaisingPolicy"]


class OracleTagPolicy(nn.Module):
    """``action = (oracle_action(tag) + offset) % 1000``: exact integer arithmetic, row by row.

    ``offset`` is a parameter, so a weight update changes the actions in a way a test can
    check against the version stamped on them.

    Args:
        offset (int, optional): added to the oracle action. Defaults to ``0``.
        extra_outputs (dict, optional): ``{key: (shape, dtype)}`` of further outputs to write
            (zeros), for pools that declare policy outputs.

    Examples:
        >>> import torch
        >>> from tensordict import TensorDict
        >>> from torchrl_asyncpool.testing.policies import OracleTagPolicy
        >>> td = TensorDict({"tag": torch.tensor([[2, 1, 3]])}, [1])
        >>> OracleTagPolicy(offset=1)(td)["action"]
        tensor([38])
    """

    in_keys = ["tag"]

    def __init__(self, offset: int = 0, extra_outputs: Optional[dict] = None):
        super().__init__()
        self.offset = nn.Parameter(torch.tensor(float(offset)), requires_grad=False)
        self.extra_outputs = dict(extra_outputs or {})

    def forward(self, td: TensorDictBase) -> TensorDictBase:
        """Writes ``"action"`` (and the zero ``extra_outputs``) into ``td`` from its ``"tag"``; returns ``td``."""
        offset = self.offset.detach().round().to(torch.int64)
        td.set("action", (oracle_action(td.get("tag")) + offset) % 1000)
        for key, (shape, dtype) in self.extra_outputs.items():
            td.set(key, torch.zeros((*td.batch_size, *shape), dtype=dtype, device=td.device))
        return td


class RaisingPolicy(OracleTagPolicy):
    """An :class:`OracleTagPolicy` that raises ``RuntimeError`` on a record whose step id reaches ``fail_at_step``.

    Shows how a failing policy is reported. The server's start-up dry run (all-zero tags)
    passes.

    Examples:
        >>> import torch
        >>> from tensordict import TensorDict
        >>> from torchrl_asyncpool.testing.policies import RaisingPolicy
        >>> policy = RaisingPolicy(fail_at_step=2)
        >>> policy(TensorDict({"tag": torch.tensor([[0, 0, 2]])}, [1]))
        Traceback (most recent call last):
        ...
        RuntimeError: RaisingPolicy: scripted failure on a record at step 2
    """

    def __init__(self, fail_at_step: int = 1, **kwargs):
        super().__init__(**kwargs)
        self.fail_at_step = int(fail_at_step)

    def forward(self, td: TensorDictBase) -> TensorDictBase:
        """As :meth:`OracleTagPolicy.forward`, but raises ``RuntimeError`` if a row's step id
        (``tag[..., 2]``) is at least ``fail_at_step``."""
        steps = td.get("tag")[..., 2]
        if bool((steps >= self.fail_at_step).any()):
            raise RuntimeError(f"RaisingPolicy: scripted failure on a record at step {int(steps.max())}")
        return super().forward(td)
