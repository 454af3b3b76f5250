"""The env worker: the loop that steps its envs (:mod:`~torchrl_asyncpool.workers.env_worker`),
writes their records into the slots (:mod:`~torchrl_asyncpool.workers.record_writer`), watches
them for hangs (:mod:`~torchrl_asyncpool.workers.watch`), and runs as a process or, for
``env_backend="threading"``, as a thread of the driver (:mod:`~torchrl_asyncpool.workers.thread_worker`).
Internals of :class:`~torchrl_asyncpool.AsyncEnvPool`; the envs themselves are stepped through
the adapters of :mod:`torchrl_asyncpool.envs`.
"""
