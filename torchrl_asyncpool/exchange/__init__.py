"""The shared-memory exchange: slot arena, slot states, doorbells and pool metrics.

The names below are imported on first use, so that asking which exchange runs
(``torchrl-asyncpool --version``) does not import torch and TensorDict.
"""
from torchrl_asyncpool._sys.lazy_exports import lazy_exports

_EXPORTS = {
    "Arena": "torchrl_asyncpool.exchange.arena",
    "ArenaLayout": "torchrl_asyncpool.exchange.arena",
    "FieldSpec": "torchrl_asyncpool.exchange.arena",
    "BellWait": "torchrl_asyncpool.exchange.doorbell",
    "Doorbell": "torchrl_asyncpool.exchange.doorbell",
    "poll_for": "torchrl_asyncpool.exchange.doorbell",
    "InheritedFd": "torchrl_asyncpool._sys.descriptors",
    "PoolMetrics": "torchrl_asyncpool.exchange.metrics",
}

__all__ = [*_EXPORTS, "slot_states"]

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, __all__)
