"""Small policies and hooks for examples and benchmarks of the inference server.

They are importable (so they pickle by reference into a server process) and deterministic. The
policies that answer the correctness oracle live in :mod:`torchrl_asyncpool.testing.policies`.
"""
from __future__ import annotations

import json
import os
from typing import Optional

import torch
from tensordict import TensorDictBase
from torch import nn

__all__ = ["MLPPolicy", "GRUPolicy", "JsonlRecorder", "read_jsonl"]


class MLPPolicy(nn.Module):
    """A seeded MLP on ``"observation"``; ``"action"`` is the argmax of its logits.

    Runs in float64 by default so that a record's action does not depend on which batch it
    was computed in (float32 matrix products may differ in the last bit between batch sizes).

    Args:
        obs_dim (int, optional): size of ``"observation"``. Defaults to ``2``.
        num_actions (int, optional): number of logits (actions). Defaults to ``1000``.
        hidden (int, optional): width of the two hidden layers. Defaults to ``64``.
        seed (int, optional): seeds the initial weights. Defaults to ``0``.
        dtype (torch.dtype, optional): parameter and compute dtype. Defaults to ``torch.float64``.
        extra_outputs (dict, optional): ``{key: (shape, dtype)}`` of further outputs to write
            (zeros), for pools that declare policy outputs.

    Examples:
        >>> import torch
        >>> from tensordict import TensorDict
        >>> from torchrl_asyncpool.inference.examples import MLPPolicy
        >>> policy = MLPPolicy(obs_dim=2)
        >>> policy(TensorDict({"observation": torch.ones(3, 2)}, [3]))["action"].shape
        torch.Size([3])
    """

    in_keys = ["observation"]

    def __init__(self, obs_dim: int = 2, num_actions: int = 1000, hidden: int = 64, seed: int = 0,
                 dtype: torch.dtype = torch.float64, extra_outputs: Optional[dict] = None):
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.dtype = dtype
        self.net = nn.Sequential(nn.Linear(obs_dim, hidden), nn.Tanh(), nn.Linear(hidden, hidden), nn.Tanh(),
                                 nn.Linear(hidden, num_actions)).to(dtype)
        with torch.no_grad():
            for p in self.net.parameters():
                p.copy_(torch.randn(p.shape, generator=gen, dtype=dtype) * 0.5)
        self.extra_outputs = dict(extra_outputs or {})

    def forward(self, td: TensorDictBase) -> TensorDictBase:
        """Writes ``"action"`` (the argmax of the logits of ``"observation"``) and the zero
        ``extra_outputs`` into ``td``; returns ``td``."""
        logits = self.net(td.get("observation").to(self.dtype))
        td.set("action", logits.argmax(-1))
        for key, (shape, dtype) in self.extra_outputs.items():
            td.set(key, torch.zeros((*td.batch_size, *shape), dtype=dtype, device=td.device))
        return td


class GRUPolicy(nn.Module):
    """A recurrent policy: ``hidden_out = GRUCell(observation, hidden_in)``, action from ``hidden_out``.

    The server stays pure-functional: the hidden state comes in with the record
    (``hidden_in``, zeroed by the env worker on ``FIRST``) and goes back in the response
    (``hidden_out``), which the worker feeds into the next record of the same env.

    Args:
        obs_dim (int): size of ``"observation"``.
        hidden (int): hidden size; the pool must declare ``hidden_out`` with shape
            ``(hidden,)`` and this policy's dtype.
        num_actions (int, optional): number of logits (actions). Defaults to ``1000``.
        seed (int, optional): seeds the initial weights. Defaults to ``0``.
        dtype (torch.dtype, optional): parameter and compute dtype. Defaults to ``torch.float64``.

    Examples:
        >>> import torch
        >>> from tensordict import TensorDict
        >>> from torchrl_asyncpool.inference.examples import GRUPolicy
        >>> policy = GRUPolicy(obs_dim=2, hidden=4)
        >>> td = TensorDict({"observation": torch.ones(1, 2), "tag": torch.zeros(1, 3, dtype=torch.long),
        ...                  "hidden_in": torch.zeros(1, 4, dtype=torch.float64)}, [1])
        >>> policy(td)["hidden_out"].shape
        torch.Size([1, 4])
    """

    in_keys = ["observation", "tag", "hidden_in"]

    def __init__(self, obs_dim: int = 2, hidden: int = 8, num_actions: int = 1000, seed: int = 0,
                 dtype: torch.dtype = torch.float64):
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.dtype = dtype
        self.cell = nn.GRUCell(obs_dim + 1, hidden).to(dtype)
        self.head = nn.Linear(hidden, num_actions).to(dtype)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=gen, dtype=dtype) * 0.5)

    def forward(self, td: TensorDictBase) -> TensorDictBase:
        """Writes ``"hidden_out"`` (one GRU step from ``"observation"``, the step id of ``"tag"``
        and ``"hidden_in"``) and ``"action"`` into ``td``; returns ``td``."""
        # the step id makes successive observations of one episode differ
        x = torch.cat([td.get("observation").to(self.dtype), td.get("tag")[..., 2:3].to(self.dtype)], -1)
        h = self.cell(x, td.get("hidden_in").to(self.dtype))
        td.set("hidden_out", h)
        td.set("action", self.head(h).argmax(-1))
        return td


class JsonlRecorder:
    """An ``on_batch`` hook appending every answered record to a JSON-lines file.

    Each line: ``{"key", "env_index", "tag", "step_type", "echo", "action", "version"}``
    (fields the batch does not hold are left out). Works in a server process: it pickles by
    reference and opens the file where it runs.

    Examples:
        >>> import tempfile, os, torch
        >>> from tensordict import TensorDict
        >>> from torchrl_asyncpool.inference.examples import JsonlRecorder, read_jsonl
        >>> path = os.path.join(tempfile.mkdtemp(), "log.jsonl")
        >>> rec = JsonlRecorder(path)
        >>> rec("policy", TensorDict({"env_index": torch.tensor([3])}, [1]),
        ...     TensorDict({"action": torch.tensor([7])}, [1]))
        >>> rec.close()
        >>> read_jsonl(path)
        [{'key': 'policy', 'env_index': 3, 'action': 7}]
    """

    fields = ("env_index", "tag", "step_type", "echo", "hidden_in")
    out_fields = ("action", "policy_version", "hidden_out")

    def __init__(self, path: str):
        self.path = path
        self._file = None

    def __call__(self, name: str, request: TensorDictBase, response: TensorDictBase) -> None:
        if self._file is None:
            self._file = open(self.path, "a", buffering=1)
        cols = {}
        for key in self.fields:
            value = request.get(key, None)
            if value is not None:
                cols[key] = value.tolist()
        for key in self.out_fields:
            value = response.get(key, None)
            if value is not None:
                cols[key] = value.tolist()
        b = request.batch_size[0]
        lines = []
        for i in range(b):
            row = {"key": name}
            row.update({k: v[i] for k, v in cols.items()})
            lines.append(json.dumps(row))
        self._file.write("\n".join(lines) + "\n")
        self._file.flush()

    def close(self):
        """Closes the file (idempotent); a later record opens it again, appending."""
        if self._file is not None:
            self._file.close()
            self._file = None

    def __getstate__(self):
        return {"path": self.path, "_file": None}


def read_jsonl(path: str) -> list:
    """Reads what a :class:`JsonlRecorder` wrote (complete lines only)."""
    if not os.path.exists(path):
        return []
    out = []
    with open(path) as f:
        for line in f:
            if line.endswith("\n"):
                out.append(json.loads(line))
    return out
