"""One batch key's execution path: staging, padding to a bucket, the policy call, outputs.

CPU: rows are gathered into a host staging batch of the largest bucket, padded by repeating
the first valid row, run through the policy, and the first ``b`` output rows are returned.

CUDA (``torch.cuda.is_available()`` and a CUDA device): two pinned host staging batches
(double buffering: batch N+1 is gathered while batch N runs), one asynchronous host-to-device
copy per leaf on a dedicated copy stream, the policy (or the CUDA graph captured for that
bucket) on a compute stream, and an asynchronous device-to-host copy of the valid output rows
into pinned host buffers guarded by one event per batch.
"""
from __future__ import annotations

import os
import time
import traceback
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import torch
from tensordict import TensorDict, TensorDictBase

from torchrl_asyncpool._sys.absent_modules import remember_absent
from torchrl_asyncpool.exchange.arena import layout_repr, missing_in_keys
from torchrl_asyncpool.exchange.gather import RowGather
from torchrl_asyncpool.inference._common import KeyPlan, key_repr, pick_bucket
from torchrl_asyncpool.inference.dtype_hint import dtype_mismatch_hint

__all__ = ["KeyRunner", "PolicyFailure"]

VALID_MASK = "valid_mask"
ENV_INDEX = "env_index"


class PolicyFailure(Exception):
    """Raised by a runner when the policy (or its outputs) failed; carries the key and traceback."""

    def __init__(self, key, message, tb=""):
        super().__init__(message)
        self.key = key
        self.message = message
        self.tb = tb


@dataclass
class Pending:
    parity: int
    b: int
    bucket: int
    version: int
    outputs: Optional[Dict] = None  # CPU: ready outputs; CUDA: None until finish
    t_launch: float = 0.0


def _zeros_td(fields, rows, device, pin=False):
    td = TensorDict({}, batch_size=[rows])
    for key, shape, dtype in fields:
        t = torch.zeros((rows, *shape), dtype=dtype)
        td.set(key, t.pin_memory() if pin else t)
    if device.type != "cpu":
        td = td.to(device)
    return td


class KeyRunner:
    """Serves one batch key (see the module docstring).

    Args:
        plan (KeyPlan): name, hash, slots and bucket ladder of the key.
        policy (callable): ``TensorDict -> TensorDict`` (or ``None``, writing in place).
        request_fields (list): ``(key, shape, dtype)`` of every request leaf the pool provides.
        response_fields (list): ``(key, shape, dtype)`` the policy must write.
        device (torch.device): where the policy runs.
        cuda_graphs (bool): capture one CUDA graph per bucket (CUDA only).
        cuda_ctx (CudaContext, optional): shared streams (CUDA only).
        recurrent (dict): ``{hidden_in: hidden_out}`` keys, for clearer start-up errors.
        arena_request (TensorDict): the pool's request records (``[num_slots]``), gathered from.
        double_buffer (bool): keep two staging buffers (always on CUDA).
        available_keys (list, optional): every request key of the pool, for the start-up error
            of a policy that reads a key the records lack (``request_fields`` may hold only the
            keys the policies read). Defaults to the keys of ``request_fields``.
    """

    def __init__(self, plan: KeyPlan, policy, request_fields, response_fields, *, device, cuda_graphs=False,
                 cuda_ctx=None, recurrent=None, arena_request: Optional[TensorDictBase] = None,
                 double_buffer: bool = False, available_keys=None):
        self.plan = plan
        self.key = plan.key
        self.policy = policy
        # a TensorDictModule probes for pandas on each call: where it is absent, a search of
        # every sys.path entry per output and batch, unless the absence is recorded once
        remember_absent()
        # a wrapper that declares it has no hooks is called through forward (see ActingPolicy)
        self._forward = policy.forward if getattr(policy, "hookless", False) else policy
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.cuda_ctx = cuda_ctx
        self.recurrent = dict(recurrent or {})
        self.request_fields = list(request_fields) + [((ENV_INDEX,), (), torch.int64)]
        self.input_fields = self.request_fields + [((VALID_MASK,), (), torch.bool)]
        self._available = None if available_keys is None else [*available_keys, (ENV_INDEX,), (VALID_MASK,)]
        self.response_fields = list(response_fields)
        self.response_keys = [k for k, _, _ in self.response_fields]
        self.buckets = plan.buckets
        # staging rows: the bucket that holds the largest chunk (plan.max_rows records)
        rows = self.staging_rows = pick_bucket(plan.buckets, plan.max_rows)
        self.version = 0
        self._parity = 0
        # two staging buffers when batch N+1 is staged before batch N is answered
        nbuf = self._nbuf = 2 if (self.cuda or double_buffer) else 1
        self._host = [_zeros_td(self.input_fields, rows, torch.device("cpu"), pin=self.cuda) for _ in range(nbuf)]
        self._host_mask = [h.get(VALID_MASK) for h in self._host]
        self._host_env_index = [h.get(ENV_INDEX) for h in self._host]
        # (arena leaf, staging leaf) pairs: records are gathered straight from their (leased) slots
        self._gathers = []
        if arena_request is not None:
            self._gathers = [
                [RowGather(arena_request.get(k), h.get(k)) for k, _, _ in self.request_fields if k != (ENV_INDEX,)]
                for h in self._host
            ]
        self._arange = torch.arange(rows)
        self._views: List[Dict[int, TensorDictBase]] = [{} for _ in range(nbuf)]
        self._graphs: Dict[int, Tuple[torch.cuda.CUDAGraph, List[torch.Tensor]]] = {}
        self.cuda_graphs = bool(cuda_graphs) and self.cuda
        if self.cuda:
            self._dev = self._host[0].to(self.device)
            self._dev_leaves = [self._dev.get(k) for k, _, _ in self.input_fields]
            self._host_all = [[h.get(k) for k, _, _ in self.input_fields] for h in self._host]
            self._dev_views: Dict[int, TensorDictBase] = {}
            self._host_out = [
                {k: torch.zeros((rows, *shape), dtype=dtype).pin_memory() for k, shape, dtype in self.response_fields}
                for _ in range(nbuf)
            ]
            self._h2d_done = [torch.cuda.Event() for _ in range(nbuf)]
            self._d2h_done = [torch.cuda.Event() for _ in range(nbuf)]
            self._inputs_free = torch.cuda.Event()
            self._h2d_used = [False] * nbuf
            self._inputs_used = False

    # -- views ------------------------------------------------------------------------------
    def _view(self, parity, rows) -> TensorDictBase:
        view = self._views[parity].get(rows)
        if view is None:
            view = self._views[parity][rows] = self._host[parity][:rows]
        return view

    def _dev_view(self, rows) -> TensorDictBase:
        view = self._dev_views.get(rows)
        if view is None:
            view = self._dev_views[rows] = self._dev[:rows]
        return view

    # -- the policy call --------------------------------------------------------------------
    def _call(self, td: TensorDictBase) -> TensorDictBase:
        out = self._forward(td)
        if out is None:
            out = td
        if not isinstance(out, TensorDictBase):
            raise TypeError(
                f"policy {self.plan.name!r} returned {type(out).__name__}; a policy maps a TensorDict to a "
                "TensorDict (or writes its outputs into the input and returns None)."
            )
        return out

    def _outputs(self, out: TensorDictBase) -> List[torch.Tensor]:
        values = []
        for key in self.response_keys:
            value = out.get(key, None)
            if value is None:
                raise KeyError(
                    f"policy {self.plan.name!r} did not write {key_repr(key)!r}; it must write every action key and "
                    f"declared policy output {[key_repr(k) for k in self.response_keys]}."
                )
            values.append(value)
        return values

    # -- start-up ---------------------------------------------------------------------------
    def dry_run(self) -> None:
        """Runs the policy once on a zero batch of the pool's request layout; raises ``ValueError``."""
        name = self.plan.name
        provided = {k for k, _, _ in self.input_fields}
        missing = missing_in_keys(self.policy, provided)
        if missing:
            available = provided if self._available is None else self._available
            raise ValueError(
                f"policy {name!r} reads {missing}, which the pool's records do not "
                f"provide; available keys: {sorted(map(str, (key_repr(k) for k in available)))}."
            )
        sizes = sorted({pick_bucket(self.buckets, 1), self.staging_rows})
        for rows in sizes:
            td = _zeros_td(self.input_fields, rows, self.device)
            td.set(VALID_MASK, torch.ones(rows, dtype=torch.bool, device=self.device))
            try:
                with torch.no_grad():
                    out = self._call(td)
            except Exception as exc:  # noqa: BLE001 - re-raised with context
                if type(exc).__name__ == "InvalidActionError":  # the action itself is wrong: say only that
                    raise ValueError(f"policy {name!r} writes actions the env cannot take: {exc}") from exc
                hint = ""
                if self.recurrent:
                    hint = (
                        f" The pool carries recurrent state {self.recurrent} with shapes "
                        f"{ {key_repr(k): tuple(s) for k, s, _ in self.request_fields if k in self._rec_in_keys()} }: "
                        "check that they match the policy's hidden size."
                    )
                # its actions must come in the pool's dtypes: casting the policy is no fix here
                dtypes = dtype_mismatch_hint({key_repr(k): d for k, _, d in self.input_fields}, self.policy,
                                             cast_policy=False)
                hint += f" {dtypes}" if dtypes else ""
                raise ValueError(
                    f"policy {name!r} failed on a zero batch of {rows} records built from the "
                    f"pool's request layout {{{layout_repr(self.input_fields)}}}: "
                    f"{type(exc).__name__}: {str(exc).rstrip('.')}.{hint}"
                ) from exc
            for (key, shape, dtype) in self.response_fields:
                value = out.get(key, None)
                what = "recurrent state output" if key in self._rec_out_keys() else "declared action/policy output"
                if value is None:
                    raise ValueError(
                        f"policy {name!r} does not write {what} {key_repr(key)!r}; "
                        f"it wrote {sorted(map(str, (key_repr(k) for k in out.keys(True, True))))}."
                    )
                want = (rows, *shape)
                if not isinstance(value, torch.Tensor) or tuple(value.shape) != want or value.dtype != dtype:
                    got = (
                        f"shape {tuple(value.shape)} and dtype {value.dtype}"
                        if isinstance(value, torch.Tensor)
                        else type(value).__name__
                    )
                    raise ValueError(
                        f"policy {name!r} writes {what} {key_repr(key)!r} with {got} for a "
                        f"batch of {rows}; the pool declares per-env shape {tuple(shape)} and dtype {dtype}, so "
                        f"shape {want} is expected."
                    )

    def _rec_in_keys(self):
        return {k if isinstance(k, tuple) else (k,) for k in self.recurrent}

    def _rec_out_keys(self):
        return {v if isinstance(v, tuple) else (v,) for v in self.recurrent.values()}

    def capture_graphs(self) -> None:
        """Captures one CUDA graph per bucket (CUDA with ``cuda_graphs=True`` only)."""
        if not self.cuda_graphs:
            return
        ctx = self.cuda_ctx
        for rows in [b for b in (self.buckets or (self.staging_rows,)) if b <= self.staging_rows]:
            static_in = self._dev_view(rows)
            static_in.get(VALID_MASK).fill_(True)
            side = torch.cuda.Stream(self.device)
            side.wait_stream(ctx.compute)
            with torch.cuda.stream(side), torch.no_grad():
                for _ in range(2):
                    self._call(static_in.copy())
            ctx.compute.wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.no_grad(), torch.cuda.graph(graph):
                outs = self._outputs(self._call(static_in.copy()))
            self._graphs[rows] = (graph, outs)
        torch.cuda.synchronize(self.device)

    # -- weights ----------------------------------------------------------------------------
    def apply_weights(self, flat: Dict[str, torch.Tensor], version: int) -> None:
        """Copies ``{dotted name: tensor}`` into the policy's parameters and buffers, in place."""
        targets = named_tensors(self.policy)
        check_weights(targets, flat, self.plan.name)
        stream = torch.cuda.stream(self.cuda_ctx.compute) if self.cuda else _nullcontext()
        with torch.no_grad(), stream:
            for name, dst in targets.items():
                dst.copy_(flat[name])
        self.version = int(version)

    # -- serving ----------------------------------------------------------------------------
    @property
    def takes_whole(self) -> bool:
        """Whether :meth:`launch` feeds a received batch to the policy as is (unpadded CPU)."""
        return not self.cuda and self.buckets is None

    def launch(self, env_idx: torch.Tensor, whole: Optional[TensorDictBase] = None) -> Pending:
        """Stages the records of slots ``env_idx`` (leased, so stable) and starts the policy on them.

        ``whole`` is the received batch when it holds exactly these records (one key, one
        chunk) and already carries its all-``True`` ``"valid_mask"``: the unpadded CPU path
        (:attr:`takes_whole`) then feeds it to the policy without another copy.
        """
        t0 = time.perf_counter()
        b = int(env_idx.numel())
        if whole is not None and self.takes_whole:
            return Pending(0, b, b, self.version, self._run_cpu(whole, b), t0)
        bucket = pick_bucket(self.buckets, b)
        parity = self._parity
        self._parity = (parity + 1) % self._nbuf
        if self.cuda:
            if self._h2d_used[parity]:
                self._h2d_done[parity].synchronize()  # host buffer still being read by an earlier copy
        # one gather per leaf fills the valid rows and the padding (copies of the first record)
        gather = env_idx if bucket == b else torch.cat([env_idx, env_idx[:1].expand(bucket - b)])
        rows = gather.numpy()
        for row_gather in self._gathers[parity]:
            row_gather(rows)
        self._host_env_index[parity][:bucket].copy_(gather)
        torch.lt(self._arange[:bucket], b, out=self._host_mask[parity][:bucket])
        if not self.cuda:
            return Pending(parity, b, bucket, self.version, self._run_cpu(self._view(parity, bucket).copy(), b), t0)
        return self._launch_cuda(parity, b, bucket, t0)

    def _run_cpu(self, td, b):
        if torch.is_grad_enabled():  # the serving loop turns grad off once for its thread
            with torch.no_grad():
                values = self._outputs(self._call(td))
        else:
            values = self._outputs(self._call(td))
        return {k: (v if v.shape[0] == b else v[:b]) for k, v in zip(self.response_keys, values)}

    def _launch_cuda(self, parity, b, bucket, t0) -> Pending:
        ctx = self.cuda_ctx
        host = self._host_all[parity]
        with torch.cuda.stream(ctx.copy):
            if self._inputs_used:
                ctx.copy.wait_event(self._inputs_free)  # the previous forward has read the device inputs
            for dst, src in zip(self._dev_leaves, host):
                dst[:bucket].copy_(src[:bucket], non_blocking=True)
            self._h2d_done[parity].record(ctx.copy)
            self._h2d_used[parity] = True
        with torch.cuda.stream(ctx.compute), torch.no_grad():
            ctx.compute.wait_event(self._h2d_done[parity])
            graph = self._graphs.get(bucket)
            if graph is not None:
                graph[0].replay()
                values = graph[1]
            else:
                values = self._outputs(self._call(self._dev_view(bucket).copy()))
            self._inputs_free.record(ctx.compute)
            self._inputs_used = True
            outs = self._host_out[parity]
            for key, value in zip(self.response_keys, values):
                outs[key][:b].copy_(value[:b], non_blocking=True)
            self._d2h_done[parity].record(ctx.compute)
        return Pending(parity, b, bucket, self.version, None, t0)

    def finish(self, pending: Pending) -> Dict:
        """Waits for a launched batch; returns ``{response key: host tensor [b]}``."""
        if pending.outputs is not None:
            return pending.outputs
        self._d2h_done[pending.parity].synchronize()
        outs = self._host_out[pending.parity]
        return {k: outs[k][: pending.b] for k in self.response_keys}

    def request_view(self, pending: Pending, whole: Optional[TensorDictBase]) -> TensorDictBase:
        """The valid request rows of a launched batch (for ``on_batch`` hooks)."""
        if whole is not None and not self.cuda and self.buckets is None:
            return whole
        return self._view(pending.parity, pending.bucket)[: pending.b]


class CudaContext:
    """The streams shared by every key of a CUDA server."""

    def __init__(self, device):
        self.device = torch.device(device)
        self.copy = torch.cuda.Stream(self.device)
        self.compute = torch.cuda.Stream(self.device)


def named_tensors(policy) -> Dict[str, torch.Tensor]:
    """``{dotted name: tensor}`` of a module's parameters and buffers (empty for plain callables)."""
    if not isinstance(policy, torch.nn.Module):
        return {}
    out = {}
    # duplicates kept (tied weights appear under every name, as in a state dict)
    for name, p in policy.named_parameters(remove_duplicate=False):
        out[name] = p
    for name, b in policy.named_buffers(remove_duplicate=False):
        out[name] = b
    return out


def check_weights(targets: Dict[str, torch.Tensor], flat: Dict[str, torch.Tensor], name: str) -> None:
    """Raises before anything is copied unless ``flat`` has exactly the names of ``targets``
    (``KeyError`` listing unknown and missing ones) with the same shapes (``ValueError``)."""
    unknown, missing = sorted(set(flat) - set(targets)), sorted(set(targets) - set(flat))
    if unknown or missing:
        raise KeyError(
            f"weights for policy {name!r} do not match its parameters: unknown {unknown[:8]}, missing {missing[:8]}."
            f"{_prefix_hint(unknown, missing)}"
        )
    for key, dst in targets.items():
        if tuple(flat[key].shape) != tuple(dst.shape):
            raise ValueError(
                f"weights for policy {name!r}: {key!r} has shape {tuple(flat[key].shape)}, expected {tuple(dst.shape)}."
            )


def _prefix_hint(unknown, missing) -> str:
    """When the unknown names are the missing ones with one dotted segment less (or more), the
    weights come from a submodule (or a wrapper) of the served policy: say which segment differs."""
    if not unknown or len(unknown) != len(missing):
        return ""
    for longer, shorter, given in ((missing, unknown, "a submodule"), (unknown, missing, "a wrapper")):
        extra = len(longer[0]) - len(shorter[0])
        if extra <= 0:
            continue
        at = len(os.path.commonprefix([longer[0], shorter[0]]))
        at = shorter[0].rfind(".", 0, at) + 1  # back to a segment boundary
        segment = longer[0][at:at + extra]
        if segment.endswith(".") and all(a == b[:at] + segment + b[at:] for a, b in zip(longer, shorter)):
            return (f" They look like the state dict of {given} of the served policy (the names differ by "
                    f"{segment!r}): pass the served module's own state_dict(), or the module itself.")
    return ""


def flatten_weights(weights) -> Dict[str, torch.Tensor]:
    """Normalizes a module, a TensorDict (``TensorDict.from_module`` layout) or a state dict.

    Args:
        weights (nn.Module, TensorDictBase or mapping): the weights as
            ``update_policy_weights_`` accepts them.

    Returns:
        dict: ``{dotted name: detached tensor}``, the names as ``state_dict()`` spells them.

    Raises:
        TypeError: ``weights`` is none of these, or a mapping holds a value that is not a tensor.

    Examples:
        >>> import torch
        >>> from tensordict import TensorDict
        >>> from torchrl_asyncpool.inference import flatten_weights
        >>> net = torch.nn.Linear(2, 1)
        >>> sorted(flatten_weights(net)) == sorted(flatten_weights(TensorDict.from_module(net))) == ["bias", "weight"]
        True
        >>> flatten_weights({"weight": 1.0})
        Traceback (most recent call last):
        ...
        TypeError: weights['weight'] is float, expected a tensor.
    """
    if isinstance(weights, torch.nn.Module):
        return {k: v.detach() for k, v in named_tensors(weights).items()}
    if isinstance(weights, TensorDictBase):
        flat = weights.flatten_keys(".")
        return {k: flat.get(k).detach() if hasattr(flat.get(k), "detach") else flat.get(k) for k in flat.keys()}
    if isinstance(weights, dict) or hasattr(weights, "items"):
        out = {}
        for k, v in weights.items():
            if not isinstance(v, torch.Tensor):
                raise TypeError(f"weights[{k!r}] is {type(v).__name__}, expected a tensor.")
            out[str(k)] = v.detach()
        return out
    raise TypeError(
        f"weights must be an nn.Module, a TensorDict of parameters or a state dict, got {type(weights).__name__}."
    )


def format_exc() -> str:
    return traceback.format_exc()


class _nullcontext:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False
