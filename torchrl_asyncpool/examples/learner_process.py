"""The start of a training script's process: the same whichever collector the script runs.

A script compares its learner on this package's collector with the same learner on TorchRL's
(``--collector torchrl``), so the learner's process must not differ between the two. It did:
tensordict probes for pandas (``importlib.util.find_spec``) on every ``TensorDictModule`` call,
and where pandas is not installed each probe searches every ``sys.path`` entry again. The
collector records the absent module once when its policy thread starts
(:func:`~torchrl_asyncpool._sys.absent_modules.remember_absent`), for its whole process, so the
learner of a script running this package's collector skipped the probes and the one running
TorchRL's did not (nor did TorchRL's collector's policy calls): ~7 % of a PPO minibatch update on
HalfCheetah under cProfile on the 2-core development machine, within the noise of a wall-clock A/B
there (9-12 ms per update either way). :func:`prepare_learner_process` does it first, in either
case, so that the comparison does not depend on it.
"""
from __future__ import annotations

import torch

from torchrl_asyncpool._sys.absent_modules import remember_absent

__all__ = ["prepare_learner_process"]


def prepare_learner_process(num_threads: int) -> list:
    """Sets the learner's torch threads and records the modules tensordict probes for on every
    call as absent where they are not installed (see the module docstring).

    Args:
        num_threads (int): ``torch.set_num_threads``'s argument, >= 1.

    Returns:
        list of str: the modules recorded as absent now (empty where they are installed, or
        were recorded before).

    Examples:
        >>> import sys, torch
        >>> from torchrl_asyncpool.examples.learner_process import prepare_learner_process
        >>> threads = torch.get_num_threads()
        >>> recorded = prepare_learner_process(1)
        >>> torch.get_num_threads()
        1
        >>> all(sys.modules[name] is None for name in recorded)
        True
        >>> torch.set_num_threads(threads)
    """
    if not isinstance(num_threads, int) or isinstance(num_threads, bool) or num_threads < 1:
        raise ValueError(f"num_threads must be an int >= 1, got {num_threads!r}.")
    torch.set_num_threads(num_threads)
    return remember_absent()
