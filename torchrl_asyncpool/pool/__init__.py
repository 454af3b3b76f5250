"""``AsyncEnvPool``: env workers around one shared-memory slot arena, with ``recv``/``send``.

The pool owns its start-up plan (:class:`~torchrl_asyncpool.pool.plan.PoolPlan`, every check
and decision taken once before anything is built), made from its arguments' checks
(:mod:`~torchrl_asyncpool.pool.arguments`), the grouping of envs into workers
(:mod:`~torchrl_asyncpool.pool.grouping`), the slot layout read from a spec env
(:mod:`~torchrl_asyncpool.pool.layout`) and seeding (:mod:`~torchrl_asyncpool.pool.seeding`); the
worker processes' start and end (:mod:`~torchrl_asyncpool.pool.processes`) and the watchdog that
restarts or reports them (:mod:`~torchrl_asyncpool.pool.watchdog`); the class itself, which builds
a plan, and its consumer side live in :mod:`~torchrl_asyncpool.pool.env_pool`.
"""
from torchrl_asyncpool._sys.lazy_exports import lazy_exports

_EXPORTS = {"AsyncEnvPool": "torchrl_asyncpool.pool.env_pool", "PoolPlan": "torchrl_asyncpool.pool.plan"}

__all__ = list(_EXPORTS)

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, __all__)
