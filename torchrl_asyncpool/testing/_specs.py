"""Spec helpers shared by the testing envs."""
import torch
from torchrl.data import Categorical, Composite


def _done_spec() -> Composite:
    """``done``/``terminated``/``truncated`` booleans of shape ``[1]``, as gymnasium envs have."""
    return Composite(
        {k: Categorical(2, shape=(1,), dtype=torch.bool) for k in ("done", "terminated", "truncated")}
    )
