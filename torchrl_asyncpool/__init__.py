"""torchrl_asyncpool: high-throughput asynchronous data collection for TorchRL (SEED RL regime).

The names below are imported on first use (PEP 562), so ``import torchrl_asyncpool`` itself
is cheap: the ``torchrl-asyncpool`` command can then handle a Ctrl-C that comes while torch
and TorchRL are still being imported (seconds on a busy machine).
"""
import importlib

__version__ = "0.1.0"

_EXPORTS = {
    "AsyncEnvPool": "torchrl_asyncpool.pool",
    "AsyncPoolCollector": "torchrl_asyncpool.collector",
    "StepType": "torchrl_asyncpool.step_type",
    "discount_from_step_type": "torchrl_asyncpool.step_type",
    "EnvError": "torchrl_asyncpool.errors",
    "WorkerDiedError": "torchrl_asyncpool.errors",
    "PoolClosedError": "torchrl_asyncpool.errors",
    "PoolStartCancelled": "torchrl_asyncpool.errors",
    "InferenceServer": "torchrl_asyncpool.inference",
    "ProcessSlotTransport": "torchrl_asyncpool.inference",
    "InferenceServerError": "torchrl_asyncpool.inference",
    "BatchKey": "torchrl_asyncpool.inference",
}

__all__ = list(_EXPORTS)


def __getattr__(name):
    module = _EXPORTS.get(name)
    if module is not None:
        value = getattr(importlib.import_module(module), name)
        globals()[name] = value
        return value
    try:  # a submodule not imported yet (``torchrl_asyncpool.pool`` after ``import torchrl_asyncpool``)
        return importlib.import_module(f"{__name__}.{name}")
    except ModuleNotFoundError as exc:
        if exc.name != f"{__name__}.{name}":
            raise
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(__all__))
