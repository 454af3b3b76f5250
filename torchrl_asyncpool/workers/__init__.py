"""The env worker: its process and its life (:mod:`~torchrl_asyncpool.workers.worker`), the
per-slot episode state machine that steps, resets and rebuilds its envs
(:mod:`~torchrl_asyncpool.workers.stepper`), a vector env stepped in lockstep
(:mod:`~torchrl_asyncpool.workers.lockstep`), one thread per env for envs that block
(:mod:`~torchrl_asyncpool.workers.env_threads`), what it does to an env outside its steps
(:mod:`~torchrl_asyncpool.workers.hosted_envs`), its chunk writes
(:mod:`~torchrl_asyncpool.workers.chunk_writer`); it
writes their records into the slots (:mod:`~torchrl_asyncpool.workers.record_writer`), watches
them for hangs (:mod:`~torchrl_asyncpool.workers.watch`), and runs as a process or, for
``env_backend="threading"``, as a thread of the driver (:mod:`~torchrl_asyncpool.workers.thread_worker`).
Internals of :class:`~torchrl_asyncpool.AsyncEnvPool`; the envs themselves are stepped through
the adapters of :mod:`torchrl_asyncpool.envs`.
"""
