"""``AsyncPoolCollector``: TorchRL's ``AsyncBatchedCollector`` with this package's data plane.

The collector (:mod:`~torchrl_asyncpool.collector.collector`) owns its configuration checks
(:mod:`~torchrl_asyncpool.collector.config`), the policy wrapper that runs in the serving loop
(:mod:`~torchrl_asyncpool.collector.acting_policy`), the checks of the actions it returns
(:mod:`~torchrl_asyncpool.collector.action_checks`) and the probe of what the policy reads and
writes (:mod:`~torchrl_asyncpool.collector.policy_layout`). It builds an
:class:`~torchrl_asyncpool.AsyncEnvPool` and an :class:`~torchrl_asyncpool.InferenceServer`.
"""
from torchrl_asyncpool._sys.lazy_exports import lazy_exports

_EXPORTS = {"AsyncPoolCollector": "torchrl_asyncpool.collector.collector"}

__all__ = list(_EXPORTS)

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, __all__)
