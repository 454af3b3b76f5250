"""Policy evaluation over a fixed set of episodes (seeds, step limits), with per-episode results.

See :func:`evaluate` and :doc:`/evaluation`.
"""
from torchrl_asyncpool.evaluation.episodes import (
    STATUSES,
    Episode,
    EpisodeResult,
    load_manifest,
    summarize,
    write_results,
)
from torchrl_asyncpool.evaluation.capacity import check_capacity
from torchrl_asyncpool.evaluation.runner import EvaluationError, EvaluationInterrupted, evaluate

__all__ = [
    "Episode", "EpisodeResult", "EvaluationError", "EvaluationInterrupted", "STATUSES", "evaluate", "check_capacity",
    "load_manifest", "summarize", "write_results",
]
