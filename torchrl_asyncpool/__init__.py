"""torchrl_asyncpool: high-throughput asynchronous data collection for TorchRL (SEED RL regime).

The names below are imported on first use (PEP 562), so ``import torchrl_asyncpool`` itself
is cheap: the ``torchrl-asyncpool`` command can then handle a Ctrl-C that comes while torch
and TorchRL are still being imported (seconds on a busy machine).
"""
from torchrl_asyncpool._sys.lazy_exports import lazy_exports

__version__ = "0.1.0"

_EXPORTS = {
    "AsyncEnvPool": "torchrl_asyncpool.pool.env_pool",
    "AsyncPoolCollector": "torchrl_asyncpool.collector.collector",
    "StepType": "torchrl_asyncpool.step_type",
    "discount_from_step_type": "torchrl_asyncpool.step_type",
    "EnvError": "torchrl_asyncpool.errors",
    "WorkerDiedError": "torchrl_asyncpool.errors",
    "PoolClosedError": "torchrl_asyncpool.errors",
    "PoolStartCancelled": "torchrl_asyncpool.errors",
    "SetupRefused": "torchrl_asyncpool.errors",
    "InferenceServer": "torchrl_asyncpool.inference",
    "ProcessSlotTransport": "torchrl_asyncpool.inference",
    "InferenceServerError": "torchrl_asyncpool.inference",
    "BatchKey": "torchrl_asyncpool.inference",
}

__all__ = list(_EXPORTS)


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, __all__)
