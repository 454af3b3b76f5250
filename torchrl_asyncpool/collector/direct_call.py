"""A plain :class:`~tensordict.nn.TensorDictModule` called as what it does: read, call, write.

``TensorDictModule.__call__`` wraps its module's call in ``nn.Module``'s hook dispatch,
tensordict's ``dispatch`` and ``skip_existing`` decorators, a keyword-argument path and a
validated ``set`` of every output: about 50 us per batch on the serving thread for a
2x64 MLP whose own call takes about 60 us (16 records, ``benchmarks/profile_serving.py``).
For a module that uses none of it, the call is exactly: read the ``in_keys`` from the batch,
call the inner module on them positionally, write its outputs at ``out_keys_source``.
:class:`DirectCall` does that, and nothing else.

Which modules qualify, once (:func:`direct_call`): a ``TensorDictModule`` or a subclass that keeps
its call path (TorchRL's ``Actor`` and ``SafeModule``: they add specs, not steps), with
positional ``in_keys``, no ``method``, no get keyword arguments and ``inplace=True``. And per
call (:meth:`DirectCall.applies`), since hooks can come and go: no hooks on the module, no
global module hooks, ``skip_existing`` off. A call that does not qualify goes through
``__call__`` as before, so the result is the same either way; only the time differs.
"""
from __future__ import annotations

from typing import Optional

import torch
from tensordict import TensorDict, TensorDictBase
from tensordict.nn import TensorDictModule
from torch.nn.modules import module as _nn_module

try:
    from tensordict.nn import skip_existing as _skip_existing
except ImportError:  # pragma: no cover - tensordict 0.14 exports it
    _skip_existing = None

__all__ = ["DirectCall", "direct_call"]

# the methods TensorDictModule's call runs through: a subclass that overrides one of them has
# its own call path and is called through __call__
_CALL_PATH = ("__call__", "_call_impl", "forward", "_call_module", "_write_to_tensordict")


def direct_call(policy) -> Optional["DirectCall"]:
    """A :class:`DirectCall` for ``policy`` when its call qualifies (see the module docstring),
    else ``None``."""
    if not isinstance(policy, TensorDictModule) or _skip_existing is None:
        return None
    cls = type(policy)
    if any(getattr(cls, name) is not getattr(TensorDictModule, name) for name in _CALL_PATH):
        return None
    if (policy._kwargs is not None or policy.method is not None or policy.method_kwargs
            or policy._get_kwargs or policy.inplace is not True):
        return None
    if not callable(policy.module):
        return None
    return DirectCall(policy)


class DirectCall:
    """Calls ``module`` (a qualifying TensorDictModule, see :func:`direct_call`) on a TensorDict
    without its dispatch machinery; :meth:`applies` says whether this call may.

    Args:
        module (TensorDictModule): the module.
    """

    def __init__(self, module: TensorDictModule):
        self.module = module
        self._in_keys = list(module.in_keys)
        self._out_keys = list(module.out_keys_source)
        self._strict = bool(module.strict)

    def applies(self) -> bool:
        """Whether a call now equals ``module(td)``: no hooks on the module or globally and
        ``skip_existing`` off (each can change between calls)."""
        m = self.module
        return not (
            m._forward_hooks or m._forward_pre_hooks or m._backward_hooks or m._backward_pre_hooks
            or _nn_module._global_forward_hooks or _nn_module._global_forward_pre_hooks
            or _nn_module._global_backward_hooks or _nn_module._global_backward_pre_hooks
            or _skip_existing()
        )

    def __call__(self, td: TensorDictBase) -> TensorDictBase:
        """Writes the module's outputs into ``td`` and returns it (call :meth:`applies` first)."""
        if self._strict:  # a missing key raises, as TensorDictModule(strict=True) does
            tensors = [td[key] for key in self._in_keys]
        else:
            tensors = [td.get(key, None) for key in self._in_keys]
        out = self.module.module(*tensors)  # read per call: a user may swap the inner module
        if out is None:
            out = ()
        elif isinstance(out, (dict, TensorDictBase)) and all(key in out for key in self._out_keys):
            out = tuple(out.get(key) for key in self._out_keys)  # as TensorDictModule reads a mapping
        elif not isinstance(out, tuple):
            out = (out,)
        if len(out) != len(self._out_keys):
            raise RuntimeError(
                f"the module returned {len(out)} outputs for out_keys {self._out_keys}; "
                "it must return one per out key."
            )
        fast = type(td) is TensorDict
        batch = td.batch_size
        device = td.device
        for key, value in zip(self._out_keys, out):
            if key == "_":  # TensorDictModule's "ignore this output"
                continue
            if (fast and isinstance(value, torch.Tensor) and value.shape[:len(batch)] == batch
                    and (device is None or value.device == device)):
                # what td.set(key, value) stores for a tensor it accepts, without re-checking it
                if isinstance(key, str):
                    td._set_str(key, value, inplace=False, validated=True)
                else:
                    td._set_tuple(key, value, inplace=False, validated=True)
            else:
                td.set(key, TensorDict.from_any(value))
        return td
