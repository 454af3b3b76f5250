"""The central inference server: bucketed fixed-shape batches, batch keys, weight sync, recurrent state in the slot.

See :class:`InferenceServer` and :class:`ProcessSlotTransport`, and the "Inference" page of
the documentation.
"""
from torchrl_asyncpool.inference._common import BatchKey, InferenceServerError, auto_flush_timeout, bucket_ladder
from torchrl_asyncpool.inference._runner import flatten_weights
from torchrl_asyncpool.inference._shared import STAT_KEYS
from torchrl_asyncpool.inference.flush_deadline import FlushDeadline
from torchrl_asyncpool.inference.server import InferenceServer
from torchrl_asyncpool.inference.transport import ProcessSlotTransport

__all__ = [
    "InferenceServer",
    "ProcessSlotTransport",
    "InferenceServerError",
    "BatchKey",
    "bucket_ladder",
    "STAT_KEYS",
    "flatten_weights",
    "auto_flush_timeout",
    "FlushDeadline",
]
