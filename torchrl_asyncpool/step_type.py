"""The per-record step type of the episode contract."""
from __future__ import annotations

import enum

import torch

__all__ = ["StepType", "discount_from_step_type"]


class StepType(enum.IntEnum):
    """Where a record sits in its episode (gymnasium ``NEXT_STEP`` autoreset semantics).

    Every record a pool delivers carries a ``"step_type"`` entry holding one of these
    values (stored as ``torch.int8``):

    * ``FIRST`` (0): the observation returned by ``reset``; reward is 0 and
      ``done``/``terminated``/``truncated`` are ``False``.
    * ``MID`` (1): an ordinary transition inside an episode.
    * ``TERMINATION`` (2): the episode ended in a terminal state; the record carries the
      real final observation and reward, ``done=terminated=True``.
    * ``TRUNCATION`` (3): the episode was cut (time limit, ...); ``done=truncated=True``,
      ``terminated=False``.

    The action sent for a ``TERMINATION``/``TRUNCATION`` record is discarded by the worker,
    which answers with the ``FIRST`` record of the next episode. The consumer never sends
    a reset.

    The discount is derived on the consumer side and never shipped: a termination
    bootstraps with 0, every other step type with 1
    (see :func:`discount_from_step_type`).

    Examples:
        >>> from torchrl_asyncpool import StepType
        >>> StepType.TERMINATION.is_last(), StepType.FIRST.is_last()
        (True, False)
        >>> int(StepType.TRUNCATION)
        3
    """

    FIRST = 0
    MID = 1
    TERMINATION = 2
    TRUNCATION = 3

    def is_last(self) -> bool:
        """Whether this record ends its episode (termination or truncation)."""
        return self >= StepType.TERMINATION


def discount_from_step_type(step_type: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Derives the bootstrap discount from step types: 0 for ``TERMINATION``, else 1.

    Args:
        step_type (torch.Tensor): integer tensor of :class:`StepType` values.
        dtype (torch.dtype, optional): dtype of the result. Defaults to ``torch.float32``.

    Examples:
        >>> import torch
        >>> from torchrl_asyncpool import StepType, discount_from_step_type
        >>> st = torch.tensor([StepType.FIRST, StepType.MID, StepType.TERMINATION, StepType.TRUNCATION])
        >>> discount_from_step_type(st)
        tensor([1., 1., 0., 1.])
    """
    return (step_type != int(StepType.TERMINATION)).to(dtype)
