"""Build of the optional C extension; the package metadata lives in pyproject.toml.

``torchrl_asyncpool.exchange._native`` (the consumer's lease and answer in C) is optional: a
machine without a C compiler or Python headers installs the package without it, and the
pure-Python exchange runs instead (``AsyncEnvPool(exchange="auto")`` picks what is there).
"""
from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "torchrl_asyncpool.exchange._native",
            ["torchrl_asyncpool/exchange/_native.c"],
            extra_compile_args=["-O2", "-std=c11", "-Wall", "-Wextra", "-Wno-unused-parameter",
                                "-Wno-missing-field-initializers", "-Wno-cast-function-type"],
            optional=True,
        )
    ]
)
