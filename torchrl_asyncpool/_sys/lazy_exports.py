"""PEP 562 lazy exports, shared by the package and its ``evaluation`` subpackage: a name is
imported from its module on first use, so importing the package itself imports no torch (the
``torchrl-asyncpool`` command can then handle a Ctrl-C that comes while torch is imported)."""
from __future__ import annotations

import importlib
import sys

__all__ = ["lazy_exports"]


def lazy_exports(package: str, exports: dict, names) -> tuple:
    """``(__getattr__, __dir__)`` for package ``package``: ``exports`` maps each exported name to
    the module it lives in (imported and cached on first use); any other attribute is tried as a
    submodule not imported yet; ``names`` (``__all__``) join ``dir()``."""

    def __getattr__(name):
        module = exports.get(name)
        if module is not None:
            value = getattr(importlib.import_module(module), name)
            setattr(sys.modules[package], name, value)
            return value
        try:  # a submodule not imported yet (``torchrl_asyncpool.pool`` after ``import torchrl_asyncpool``)
            return importlib.import_module(f"{package}.{name}")
        except ModuleNotFoundError as exc:
            if exc.name != f"{package}.{name}":
                raise
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    def __dir__():
        return sorted(set(vars(sys.modules[package])) | set(names))

    return __getattr__, __dir__
