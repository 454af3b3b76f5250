"""Env worker processes: the env adapters, the slot specs and the worker loop (internals of
:class:`~torchrl_asyncpool.AsyncEnvPool`)."""
