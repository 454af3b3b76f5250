"""torchrl_asyncpool: high-throughput asynchronous data collection for TorchRL (SEED RL regime)."""
from torchrl_asyncpool.errors import EnvError, PoolClosedError, PoolStartCancelled, WorkerDiedError
from torchrl_asyncpool.pool import AsyncEnvPool
from torchrl_asyncpool.collector import AsyncPoolCollector
from torchrl_asyncpool.step_type import StepType, discount_from_step_type
from torchrl_asyncpool.inference import BatchKey, InferenceServer, InferenceServerError, ProcessSlotTransport

__version__ = "0.1.0"

__all__ = [
    "AsyncEnvPool",
    "AsyncPoolCollector",
    "StepType",
    "discount_from_step_type",
    "EnvError",
    "WorkerDiedError",
    "PoolClosedError",
    "PoolStartCancelled",
    "InferenceServer",
    "ProcessSlotTransport",
    "InferenceServerError",
    "BatchKey",
]
