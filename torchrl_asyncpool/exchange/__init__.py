"""The shared-memory exchange: slot arena, slot states, doorbells and pool metrics."""
from torchrl_asyncpool.exchange import slot_states
from torchrl_asyncpool.exchange.arena import Arena, ArenaLayout, FieldSpec
from torchrl_asyncpool.exchange.doorbell import BellWait, Doorbell, poll_for
from torchrl_asyncpool._sys.descriptors import InheritedFd
from torchrl_asyncpool.exchange.metrics import PoolMetrics

__all__ = [
    "Arena", "ArenaLayout", "BellWait", "FieldSpec", "Doorbell", "InheritedFd", "PoolMetrics", "poll_for",
    "slot_states",
]
