"""Build of the optional C extension; the package metadata lives in pyproject.toml.

``torchrl_asyncpool.exchange._native`` (the consumer's lease and answer in C, the workers'
stores, doorbells, idle polling) is optional: a machine without a C compiler or Python headers
installs the package without it, and the pure-Python exchange runs instead
(``AsyncEnvPool(exchange="auto")`` picks what is there). It is one module built from one file
per concept under ``torchrl_asyncpool/exchange/csrc/`` (``native.h`` says which file holds what);
MANIFEST.in ships them in the source distribution.
"""
from pathlib import Path

from setuptools import Extension, setup

CSRC = Path("torchrl_asyncpool") / "exchange" / "csrc"
SOURCES = ["module.c", "engine.c", "stores.c", "step_loop.c", "doorbell.c", "idle_poll.c", "wake_probe.c"]

setup(
    ext_modules=[
        Extension(
            "torchrl_asyncpool.exchange._native",
            [str(CSRC / name) for name in SOURCES],
            depends=[str(CSRC / "native.h")],  # a changed header rebuilds every source
            extra_compile_args=["-O2", "-std=c11", "-Wall", "-Wextra", "-Wno-unused-parameter",
                                "-Wno-missing-field-initializers", "-Wno-cast-function-type"],
            optional=True,
        )
    ]
)
