"""Start-up: from a pool's layout and the server arguments to validated plans and runners."""
from __future__ import annotations

from collections.abc import Mapping
from typing import Dict, List, Optional

import torch

from torchrl_asyncpool.inference._common import (
    KeyPlan,
    ServerSpec,
    as_key,
    bucket_ladder,
    config_hash,
    key_repr,
    resolve_slot_keys,
)
from torchrl_asyncpool.inference._runner import CudaContext, KeyRunner

__all__ = ["make_plans", "build_runners", "layout_fields"]


def policy_reads(policies, layout, on_batch=None) -> Optional[List[tuple]]:
    """The request keys the policies read, when every one of them declares its ``in_keys``
    (TorchRL modules do), the union of those present in the layout; ``None`` (every key) when
    one does not, or when an ``on_batch`` hook sees the batches. Batches then carry only these
    keys: the rest is never copied out of the slots (nor to the policy's device)."""
    if on_batch is not None:
        return None
    present = [f.key for f in layout.request]
    wanted = set()
    for policy in policies:
        try:
            in_keys = policy.in_keys
            keys = {k if isinstance(k, tuple) else (k,) for k in in_keys}
        except Exception:  # noqa: BLE001 - no (or an unusable) in_keys: the policy may read anything
            return None
        wanted |= keys
    return [k for k in present if k in wanted]


def layout_fields(layout, version_key, stamp_version, keys=None):
    """``(request fields, response fields the policy must write, recurrent map)`` of a pool
    layout; ``keys`` restricts the request fields (see :func:`policy_reads`)."""
    request = [(f.key, tuple(f.shape), f.dtype) for f in layout.request if keys is None or f.key in keys]
    vkey = as_key(version_key) if stamp_version else None
    response = [(f.key, tuple(f.shape), f.dtype) for f in layout.response if f.key != vkey]
    recurrent = dict(layout.recurrent)
    return request, response, recurrent


def version_stamping(layout, version_key) -> bool:
    """Whether the pool declared ``version_key`` as a policy output (then it must be int64 ``[]``)."""
    if version_key is None:
        return False
    vkey = as_key(version_key)
    for f in layout.response:
        if f.key == vkey:
            if tuple(f.shape) != () or f.dtype != torch.int64:
                raise ValueError(
                    f"the pool declares {key_repr(vkey)!r} with shape {tuple(f.shape)} and dtype {f.dtype}; the "
                    "server stamps the policy version there, which needs shape () and dtype torch.int64."
                )
            return True
    return False


def make_plans(layout, *, names, targets: Mapping, configs: Optional[Mapping], slot_keys, bucket_sizes,
               min_get, max_get) -> tuple:
    """Validates the key binding and bucket ladders; returns ``(plans, slot_key, hashes)``."""
    n = layout.num_slots
    if min_get > n:
        raise ValueError(f"min_get={min_get} exceeds the pool's {n} env slots.")
    if max_get is not None and max_get < min_get:
        raise ValueError(f"max_get={max_get} must be >= min_get={min_get}.")
    cap = n if max_get is None else min(max_get, n)
    configs = dict(configs or {})
    unknown_cfg = sorted(set(configs) - set(names))
    if unknown_cfg:
        raise ValueError(f"policy_configs names unknown policies {unknown_cfg}; known: {names}.")
    if isinstance(bucket_sizes, Mapping):
        unknown_b = sorted(set(bucket_sizes) - set(names))
        if unknown_b:
            raise ValueError(f"bucket_sizes names unknown policies {unknown_b}; known: {names}.")
    # hashes need the ladders, ladders need the slot counts, slot counts need names only
    counts_binding = resolve_slot_keys(
        (
            [k[0] if isinstance(k, tuple) and k else getattr(k, "name", k) for k in slot_keys]
            if slot_keys is not None
            else None
        ),
        names, {nm: "" for nm in names}, n,
    )
    ladders = {}
    max_rows = {}
    for k, name in enumerate(names):
        slots = sum(1 for s in counts_binding if s == k)
        rows = max(1, min(cap, slots))
        spec = bucket_sizes.get(name, "auto") if isinstance(bucket_sizes, Mapping) else bucket_sizes
        ladder = bucket_ladder(rows, spec)
        ladders[name] = ladder
        max_rows[name] = rows if ladder is None else min(rows, ladder[-1])
    hashes = {name: config_hash(name, targets[name], configs.get(name), ladders[name]) for name in names}
    slot_key = resolve_slot_keys(slot_keys, names, hashes, n)
    plans = [
        KeyPlan(k, name, hashes[name], [s for s, kk in enumerate(slot_key) if kk == k], ladders[name], max_rows[name])
        for k, name in enumerate(names)
    ]
    return plans, slot_key, hashes


def build_runners(spec: ServerSpec, policies: Dict[str, object], layout, arena_request=None,
                  keys=None) -> List[KeyRunner]:
    """Moves policies to the device, builds one runner per key, dry-runs and captures graphs."""
    device = torch.device(spec.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={spec.device!r} but CUDA is not available in this process.")
    if spec.cuda_graphs and device.type != "cuda":
        raise ValueError("cuda_graphs=True needs a CUDA device.")
    request, response, recurrent = layout_fields(layout, spec.policy_version_key, spec.stamp_version, keys)
    ctx = CudaContext(device) if device.type == "cuda" else None
    runners = []
    for plan in spec.plans:
        policy = policies[plan.name]
        if not callable(policy):
            raise TypeError(f"policy {plan.name!r} is not callable (got {type(policy).__name__}).")
        if device.type != "cpu" and isinstance(policy, torch.nn.Module):
            policy = policy.to(device)
        runner = KeyRunner(
            plan, policy, request, response, device=device, cuda_graphs=spec.cuda_graphs, cuda_ctx=ctx,
            recurrent=recurrent, arena_request=arena_request, double_buffer=spec.overlap,
            available_keys=[f.key for f in layout.request],
        )
        runner.dry_run()
        runner.version = int(spec.initial_versions.get(plan.name, 0))
        runners.append(runner)
    for runner in runners:
        runner.capture_graphs()
    return runners
