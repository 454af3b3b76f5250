"""Policy evaluation over a fixed set of episodes (seeds, step limits), with per-episode results.

See :func:`evaluate` and :doc:`/evaluation`.

The names below are imported on first use (PEP 562): the episodes, the results and their JSON
files (:mod:`~torchrl_asyncpool.evaluation.episodes`) need no torch, so ``torchrl-asyncpool
eval`` can write every episode's result ("not started") on a Ctrl-C that comes while torch is
still being imported; :func:`evaluate` and :func:`check_capacity` import it.
"""
import importlib

_EXPORTS = {
    "STATUSES": "torchrl_asyncpool.evaluation.episodes",
    "Episode": "torchrl_asyncpool.evaluation.episodes",
    "EpisodeResult": "torchrl_asyncpool.evaluation.episodes",
    "load_manifest": "torchrl_asyncpool.evaluation.episodes",
    "summarize": "torchrl_asyncpool.evaluation.episodes",
    "write_results": "torchrl_asyncpool.evaluation.episodes",
    "check_capacity": "torchrl_asyncpool.evaluation.capacity",
    "EvaluationError": "torchrl_asyncpool.evaluation.runner",
    "EvaluationInterrupted": "torchrl_asyncpool.evaluation.runner",
    "evaluate": "torchrl_asyncpool.evaluation.runner",
}

__all__ = [
    "Episode", "EpisodeResult", "EvaluationError", "EvaluationInterrupted", "STATUSES", "evaluate", "check_capacity",
    "load_manifest", "summarize", "write_results",
]


def __getattr__(name):
    module = _EXPORTS.get(name)
    if module is not None:
        value = getattr(importlib.import_module(module), name)
        globals()[name] = value
        return value
    try:  # a submodule not imported yet (``from torchrl_asyncpool.evaluation import runner``)
        return importlib.import_module(f"{__name__}.{name}")
    except ModuleNotFoundError as exc:
        if exc.name != f"{__name__}.{name}":
            raise
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(__all__))
