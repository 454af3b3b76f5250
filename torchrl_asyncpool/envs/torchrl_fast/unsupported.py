"""What every check of the TorchRL fast path raises when an env must stay on TorchRL's own
stepping (:class:`FastPathUnsupported`, its message the reason), and the dtype mapping the checks
compare TorchRL's specs with (:func:`np_dtype`)."""
from __future__ import annotations

import numpy as np
import torch

__all__ = ["FastPathUnsupported", "np_dtype"]


class FastPathUnsupported(Exception):
    """Why an env stays on TorchRL's own stepping (the message is the reason)."""


def np_dtype(dtype: torch.dtype) -> np.dtype:
    """The numpy dtype of a torch dtype (what ``tensor.numpy()`` gives)."""
    return torch.empty((), dtype=dtype).numpy().dtype
