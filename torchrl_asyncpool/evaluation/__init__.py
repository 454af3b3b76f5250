"""Policy evaluation over a fixed set of episodes (seeds, step limits), with per-episode results.

See :func:`evaluate` and :doc:`/evaluation`.

The names below are imported on first use (PEP 562): the episodes, the results and their JSON
files (:mod:`~torchrl_asyncpool.evaluation.episodes`) need no torch, so ``torchrl-asyncpool
eval`` can write every episode's result ("not started") on a Ctrl-C that comes while torch is
still being imported; :func:`evaluate` and :func:`check_capacity` import it.
"""
from torchrl_asyncpool._sys.lazy_exports import lazy_exports

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


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, __all__)
