"""The acting policy's cost per batch size, timed once at start-up on zero records.

The serving loop's flush deadline pays only when a bigger batch costs less per record than a
small one: a policy whose cost grows in step with its batch (a large CNN on a CPU) gains nothing
from fuller batches except the serving loop's fixed cost per batch, while a small MLP, or any
policy on a GPU, costs about the same for 1 record as for 64. :func:`measure_policy_cost` times
the policy on a few batch sizes (the fastest of a few calls each, so that a moment's load on the
machine counts less) within a small time budget (0.2 s: it delays the start); the collector reports the table in its
``plan()`` with the per-record gain of its largest batch (:func:`batch_gain`); the serving loop's
:class:`~torchrl_asyncpool.inference.FlushDeadline` measures the outcome itself, by trying.
"""
from __future__ import annotations

import time
from typing import Dict, Mapping, Optional, Sequence

import torch
from tensordict import TensorDict

__all__ = ["measure_policy_cost", "batch_gain", "COST_SIZES"]

#: batch sizes timed at start-up (those above the number of envs are left out)
COST_SIZES = (1, 8, 64)
#: calls per size; the fastest counts
_REPEATS = 3
#: seconds the whole measurement may take (sizes past it are left out)
_BUDGET_S = 0.2


def measure_policy_cost(policy, request: Mapping, sizes: Sequence[int] = COST_SIZES, *, device=None,
                        num_envs: Optional[int] = None, budget_s: float = _BUDGET_S) -> Dict[int, float]:
    """Times ``policy`` on batches of zero records.

    Args:
        policy (callable): ``TensorDict -> TensorDict``, as the serving loop calls it.
        request (mapping): ``{key: (shape, dtype)}`` of one record's entries.
        sizes (sequence of int, optional): the batch sizes to time. Defaults to
            :data:`COST_SIZES`.

    Keyword Args:
        device (torch.device, optional): where the records are built (the policy's device).
        num_envs (int, optional): leave out sizes above it, and time it too when it is not
            in ``sizes``.
        budget_s (float, optional): stop timing new sizes once this many seconds are spent.

    Returns:
        ``{batch size: seconds per call}`` (the fastest of a few calls); empty when the policy
        raised on zero records (its cost is then unknown, not an error: the collector's own
        probe already ran it).

    Examples:
        >>> import torch
        >>> from torchrl_asyncpool.collector.policy_cost import measure_policy_cost
        >>> net = torch.nn.Linear(4, 2)
        >>> def policy(td):
        ...     return td.set("action", net(td["observation"]).argmax(-1))
        >>> cost = measure_policy_cost(policy, {"observation": ((4,), torch.float32)}, num_envs=16)
        >>> sorted(cost)
        [1, 8, 16]
    """
    wanted = sorted({int(s) for s in sizes if num_envs is None or s <= num_envs} | (
        {int(num_envs)} if num_envs else set()))
    out: Dict[int, float] = {}
    start = time.perf_counter()
    grad = torch.is_grad_enabled()
    torch.set_grad_enabled(False)
    try:
        for b in wanted:
            if time.perf_counter() - start > budget_s:
                break
            td = TensorDict({k: torch.zeros((b, *shape), dtype=dtype) for k, (shape, dtype) in request.items()},
                            [b], device=device)
            td.set("env_index", torch.arange(b))
            td.set("valid_mask", torch.ones(b, dtype=torch.bool))
            best = float("inf")
            for _ in range(_REPEATS):
                t0 = time.perf_counter()
                policy(td.clone(False))
                best = min(best, time.perf_counter() - t0)
            out[b] = best
    except Exception:  # noqa: BLE001 - a policy that refuses zero records: its cost is unknown
        return {}
    finally:
        torch.set_grad_enabled(grad)
    return out


def batch_gain(cost: Mapping[int, float]) -> Optional[float]:
    """The share of the per-record policy cost that the largest timed batch saves against
    single records: ``1 - (cost[b] / b) / cost[1]`` (``None`` without both sizes).

    Examples:
        >>> from torchrl_asyncpool.collector.policy_cost import batch_gain
        >>> round(batch_gain({1: 40e-6, 64: 80e-6}), 3)  # a small MLP: fuller batches are nearly free
        0.969
        >>> round(batch_gain({1: 3e-3, 16: 48e-3}), 3)  # a CNN on a CPU: cost in step with the batch
        0.0
    """
    if 1 not in cost or len(cost) < 2 or cost[1] <= 0.0:
        return None
    b = max(cost)
    return max(0.0, 1.0 - (cost[b] / b) / cost[1])
