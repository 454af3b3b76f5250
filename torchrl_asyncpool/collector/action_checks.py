"""What the collector checks in the actions its policy writes, before any env steps on them.

A policy bug must not become silently corrupted training data: a float action for an integer
spec is not truncated, a NaN is not turned into ``-2**63``, an index past a categorical's ``n``
is not handed to the env. Per action key, on every batch, in the acting policy (the inference
server's thread or process), :class:`ActionCheck`:

- **dtype**: the spec's dtype is what lands in the slot. A float action for an integer or
  boolean spec is cast only when every value is a whole number (a ``OneHotCategorical`` sample
  is a float one-hot vector); a fractional value is refused, as it would be truncated
  (``cast_actions=True`` is the one opt-in that casts it anyway, as ``Tensor.to`` does: toward
  zero, and as TorchRL's collectors pass such actions on, without the bounds check below). An
  integer or boolean action for an integer spec, and a float one for a float spec of
  another width, are cast (the bounds below still apply).
- **finite**: a float action with a NaN or an infinity is refused.
- **bounds** (``check_action_bounds=True``, the default): values of a ``Categorical`` (``0 <=
  a < n``), ``OneHot`` (zeros and exactly one 1 per row), ``Binary`` (0 or 1) or integer
  ``Bounded`` spec (``low <= a <= high``, element-wise) are checked, and so is the range of the
  integer dtype an integer action is cast to. Continuous bounds are not (a Gaussian policy's
  samples outside a box are the env's to clip, as TorchRL leaves them). Specs of other types
  only get the checks above.

Shapes are checked where the actions are written into the slots (``AsyncEnvPool.send``'s rule).
Each check is one tensor reduction per batch for an integer action of a ``Categorical``,
``Binary`` or integer-range spec and for a float action of a float spec, a few for the other
cases (``check_action_bounds=False`` saves the bounds part); on a CUDA policy they synchronise
the stream once per batch.
"""
from __future__ import annotations

import math

import numpy as np
import torch

__all__ = ["ActionCheck", "InvalidActionError", "action_checks"]


class InvalidActionError(ValueError):
    """An action the policy wrote does not fit the env's action spec.

    Attributes:
        key (NestedKey): the action key.
        rows (torch.Tensor): the batch rows holding the offending actions (the inference server
            names their envs).
    """

    def __init__(self, message: str, key, rows: torch.Tensor):
        super().__init__(message)
        self.key = key
        self.rows = rows


class ActionCheck:
    """The checks (and the casts) of one action key; see the module docstring.

    Args:
        key (NestedKey): the action key (for messages).
        dtype (torch.dtype): the slot's dtype (the spec's).
        spec (TensorSpec, optional): the key's spec for one env (no batch dimension), read for
            its bounds; ``None`` checks dtype and finiteness only.

    Keyword Args:
        cast (bool, optional): cast float actions for integer/boolean specs instead of refusing
            them. Defaults to ``False``.
        bounds (bool, optional): check discrete bounds. Defaults to ``True``.

    Examples:
        >>> import torch
        >>> from torchrl.data import Categorical
        >>> check = ActionCheck("action", torch.int64, Categorical(3))
        >>> check(torch.tensor([0, 2]))
        tensor([0, 2])
        >>> try:
        ...     check(torch.tensor([0.0, 2.7]))
        ... except ValueError as err:
        ...     print(str(err).split(",")[0])
        'action' is torch.float32 with fractional values (e.g. 2.700000047683716)
        >>> check(torch.tensor([1.0, 2.0]))  # whole numbers: cast exactly
        tensor([1, 2])
        >>> try:
        ...     check(torch.tensor([1, 3]))
        ... except ValueError as err:
        ...     print(err)
        'action' has values outside the Categorical spec: 3 (expected 0 <= action < 3).
    """

    def __init__(self, key, dtype: torch.dtype, spec=None, *, cast: bool = False, bounds: bool = True):
        self.key = key
        self.dtype = dtype
        self.cast = cast
        self.kind = type(spec).__name__ if spec is not None else "spec"
        self.integer = not (dtype.is_floating_point or dtype.is_complex)
        self.rule = None  # (kind, arguments) of the bounds check, or None
        if bounds and spec is not None and self.integer:
            n = getattr(getattr(spec, "space", None), "n", None)
            name = type(spec).__name__
            if name in ("Categorical", "DiscreteTensorSpec") and n is not None:
                self.rule = ("range", 0, n - 1, f"0 <= action < {n}")
            elif name in ("OneHot", "OneHotDiscreteTensorSpec"):
                self.rule = ("onehot", n)
            elif name in ("Binary", "BinaryDiscreteTensorSpec"):
                self.rule = ("range", 0, 1, "0 or 1")
            elif hasattr(getattr(spec, "space", None), "low"):
                low, high = spec.space.low, spec.space.high
                self.rule = ("box", low.to(torch.float64), high.to(torch.float64), "low <= action <= high")
                self._box_np = (self.rule[1].numpy(), self.rule[2].numpy())
        # an action already of the slot's dtype fits that dtype's range: the fast pass skips it
        self._dtype_range = False
        if bounds and self.integer and self.rule is None and dtype != torch.bool:
            info = torch.iinfo(dtype)  # an integer action cast to this dtype must fit it
            self.rule = ("range", info.min, info.max, f"{info.min} <= action <= {info.max} ({dtype})")
            self._dtype_range = True

    def __call__(self, value: torch.Tensor) -> torch.Tensor:
        """Returns ``value`` (cast to the spec's dtype where the rules allow) or raises
        :class:`InvalidActionError`."""
        # the common case, a CPU batch that passes, in one torch reduction (_fine_torch) or a few
        # numpy ones (_fine); anything else is looked at again in torch to say what is wrong
        fine = self._fine_torch(value)
        if fine is None:
            try:
                fine = self._fine(value.numpy())
            except (TypeError, RuntimeError):  # a device tensor, a dtype numpy lacks, one that needs grad
                fine = False
        if fine:
            return value if value.dtype == self.dtype else value.to(self.dtype)
        return self._checked(value)

    def _fine_torch(self, value: torch.Tensor):
        """Whether a CPU batch passes, for the two common cases, in one torch reduction: an
        integer action for an integer spec with a range rule (one ``aminmax``), a float action
        for a float spec (one ``sum``: NaN or an infinity makes it non-finite; a finite batch
        whose sum overflows is only sent to the full check). ``None`` for any other case.

        Measured right after a policy's forward pass in the serving loop, a numpy reduction
        costs 20-30 us there (its code is cold after the policy's torch kernels) against
        5-15 us for these, although numpy is the cheaper of the two in a loop of checks alone.
        """
        if not value.is_cpu or value.requires_grad:
            return None
        dtype = value.dtype
        if dtype.is_floating_point:
            return None if self.integer else math.isfinite(value.sum().item())
        if dtype == torch.bool or dtype.is_complex:
            return None
        if not self.integer:
            return True  # an integer action for a float spec: cast exactly
        rule = self.rule
        if rule is None or (self._dtype_range and dtype == self.dtype) or value.numel() == 0:
            return True
        if rule[0] != "range":
            return None
        low, high = torch.aminmax(value)
        return low.item() >= rule[1] and high.item() <= rule[2]

    def _fine(self, a: np.ndarray) -> bool:
        """Whether the batch ``a`` passes every check (the rules of :meth:`_checked`)."""
        if a.dtype.kind in "fc":
            if not np.isfinite(a).all():
                return False
            if self.integer and not self.cast and (a != np.trunc(a)).any():
                return False
            if not self.integer or self.cast:
                return True  # float specs have no bounds checked; cast_actions skips them
        elif not self.integer:
            return True
        rule = self.rule
        if rule is None or not a.size:
            return True
        if rule[0] == "onehot":
            if not self._onehot_rows(a.shape):
                return False
            return bool(((a == 0) | (a == 1)).all() and (a.sum(-1, dtype=np.int64) == 1).all())
        if rule[0] == "box":
            low, high = self._box_np
            return bool((a >= low).all() and (a <= high).all())
        # as Python numbers: compared in a narrow numpy dtype (float16), a bound would overflow
        return a.min().item() >= rule[1] and a.max().item() <= rule[2]

    def _checked(self, value: torch.Tensor) -> torch.Tensor:
        key = self.key
        if value.dtype.is_floating_point or value.dtype.is_complex:
            finite = torch.isfinite(value)
            if not bool(finite.all()):
                rows = (~finite).reshape(len(value), -1).any(-1).nonzero().squeeze(-1)
                raise InvalidActionError(
                    f"{key!r} holds NaN or infinite values (rows {rows.tolist()} of the batch).", key, rows
                )
            if self.integer and self.cast:  # the opt-in: TorchRL's unchecked cast
                return value.to(self.dtype)
            if self.integer:
                fractional = (value != value.trunc()).reshape(len(value), -1).any(-1)
                if bool(fractional.any()):
                    rows = fractional.nonzero().squeeze(-1)
                    raise InvalidActionError(
                        f"{key!r} is {value.dtype} with fractional values (e.g. {value[rows[0]].tolist()}), but the "
                        f"action spec ({self.kind}) is {self.dtype}: they would be truncated. Write integer actions "
                        "(e.g. a categorical sample or an argmax), or pass cast_actions=True to cast them as "
                        "Tensor.to does.", key, rows
                    )
        elif not self.integer:  # an integer action for a float spec: exact, as int -> float is
            return value.to(self.dtype)
        if self.rule is not None:
            self._check_bounds(value)
        return value if value.dtype == self.dtype else value.to(self.dtype)

    def _onehot_rows(self, shape) -> bool:
        """Whether a batch of this ``shape`` holds rows of the one-hot spec's width: a batch of
        action indices (no row axis) is not a batch of one row."""
        n = self.rule[1]
        return len(shape) >= 2 and (n is None or shape[-1] == n)

    def _check_bounds(self, value: torch.Tensor) -> None:
        rule, key = self.rule, self.key
        if rule[0] == "onehot":
            if not self._onehot_rows(value.shape):
                bad = torch.ones(len(value), dtype=torch.bool, device=value.device)
            else:
                ok = ((value == 0) | (value == 1)).all(-1) & (value.to(torch.int64).sum(-1) == 1)
                bad = ~ok.reshape(len(value), -1).all(-1)
            # the usual cause: an action index (an argmax, a Categorical sample) for a TorchRL env
            # whose Discrete action space became a OneHot spec (GymEnv's default encoding)
            rows_of = f" of {rule[1]}" if rule[1] is not None else ""
            expected = (f"one-hot rows{rows_of}: zeros and exactly one 1; a policy that writes action indices needs "
                        "the env built with categorical_action_encoding=True (TorchRL's GymEnv / GymWrapper), or "
                        "torch.nn.functional.one_hot(index, n) of its indices")
        else:
            low, high, expected = rule[1], rule[2], rule[3]
            if rule[0] == "box":
                low, high = low.to(value.device), high.to(value.device)
                compared = value.to(torch.float64)
            else:  # int64: a bound outside a narrower integer dtype would wrap around in it
                compared = value if value.dtype.is_floating_point else value.to(torch.int64)
            bad = ((compared < low) | (compared > high)).reshape(len(value), -1).any(-1)
        if bool(bad.any()):
            rows = bad.nonzero().squeeze(-1)
            shown = value[rows[:4]].tolist()
            shown = shown[0] if len(rows) == 1 else shown
            raise InvalidActionError(
                f"{key!r} has values outside the {self.kind} spec: {shown} (expected {expected}).", key, rows
            )


def action_checks(full_action_spec, dtypes: dict, *, cast: bool = False, bounds: bool = True) -> dict:
    """``{key: ActionCheck}`` for every action key, from a pool's batched ``full_action_spec``
    (leading dimension ``num_envs``) and its slot dtypes ``{key: dtype}``.

    Args:
        full_action_spec (Composite): the pool's ``full_action_spec``.
        dtypes (dict): the action slots' dtypes.

    Keyword Args:
        cast (bool, optional): see :class:`ActionCheck`. Defaults to ``False``.
        bounds (bool, optional): see :class:`ActionCheck`. Defaults to ``True``.
    """
    checks = {}
    for key, dtype in dtypes.items():
        try:
            spec = full_action_spec[key][0]
        except (KeyError, IndexError, TypeError, RuntimeError):
            spec = None
        checks[key] = ActionCheck(key, dtype, spec, cast=cast, bounds=bounds)
    return checks
