"""Row gathers that stay on the calling thread.

``torch.index_select`` splits large copies (pixel observations) across torch's intra-op
thread pool. On a machine whose cores are busy with env workers, the consumer then waits for
a helper thread that is not scheduled, and the idle helper takes CPU the workers need:
profiling measured ~2 ms per 32-row pixel gather with 2 threads against ~12 us with one.
numpy's ``take`` never starts threads, so every hot-path gather goes through it (torch is only
used for dtypes numpy lacks, such as bfloat16, or non-CPU destinations).
"""
from __future__ import annotations

import numpy as np
import torch

__all__ = ["RowGather", "numpy_or_none"]


def numpy_or_none(t: torch.Tensor):
    """A numpy view of ``t``, or ``None`` where numpy cannot alias it (bfloat16, CUDA, ...)."""
    try:
        return t.numpy()
    except (TypeError, RuntimeError):
        return None


class RowGather:
    """Copies rows of ``src`` into ``dst[start:start + len(rows)]``.

    Args:
        src (torch.Tensor): ``[N, ...]`` source (a shared-memory field).
        dst (torch.Tensor): ``[M, ...]`` destination with the same trailing shape.

    Examples:
        >>> import numpy as np, torch
        >>> from torchrl_asyncpool.exchange.gather import RowGather
        >>> src, dst = torch.arange(12).view(6, 2), torch.zeros(4, 2, dtype=torch.int64)
        >>> RowGather(src, dst)(np.array([4, 1]), start=1)
        >>> dst.tolist()
        [[0, 0], [8, 9], [2, 3], [0, 0]]
    """

    __slots__ = ("_src", "_dst", "_numpy")

    def __init__(self, src: torch.Tensor, dst: torch.Tensor):
        src_np, dst_np = numpy_or_none(src), numpy_or_none(dst)
        self._numpy = src_np is not None and dst_np is not None
        # otherwise (bfloat16, CUDA, ...) torch's own gather
        self._src, self._dst = (src_np, dst_np) if self._numpy else (src, dst)

    def __call__(self, rows: np.ndarray, start: int = 0) -> None:
        end = start + len(rows)
        if self._numpy:
            self._src.take(rows, 0, self._dst[start:end], "clip")  # the method: no np.take wrapper frames
        else:
            torch.index_select(self._src, 0, torch.from_numpy(np.ascontiguousarray(rows)), out=self._dst[start:end])
