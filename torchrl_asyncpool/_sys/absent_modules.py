"""Optional modules that are not installed, remembered so that probing for them costs nothing.

tensordict 0.14's ``TensorDict.from_any`` calls ``importlib.util.find_spec("pandas")`` for every
tensor it is given, and ``TensorDictModule`` gives it each output of each call. Where pandas is
not installed, every probe searches every ``sys.path`` entry again (Python caches found modules,
not failed searches): about 50 us per policy output per call on a 2-core machine, more than a
2x64 MLP's whole forward pass on a batch of 16, on the inference server's path for every batch.

Python's own way to record "this module is absent" is a ``None`` entry in ``sys.modules``:
``find_spec`` then answers ``None`` from that dict, and ``import`` raises the
``ModuleNotFoundError`` it raises anyway for a module that is not installed. Only modules that
are absent when :func:`remember_absent` runs get the entry; the one visible difference is that a
module installed later, while the same process runs, cannot be imported by that process.
"""
from __future__ import annotations

import importlib.util
import sys
from typing import Iterable, List

__all__ = ["PROBED_PER_CALL", "remember_absent"]

#: modules a policy call probes for on every call (see the module docstring)
PROBED_PER_CALL = ("pandas",)


def remember_absent(names: Iterable[str] = PROBED_PER_CALL) -> List[str]:
    """Records each top-level module of ``names`` that is not installed as absent
    (``sys.modules[name] = None``); returns the names it recorded now.

    A module that is imported, or recorded already, is left alone, and so is one that is
    installed: its probes do not search (imported) or search once per call as before.

    Examples:
        >>> import importlib.util, sys
        >>> from torchrl_asyncpool._sys.absent_modules import remember_absent
        >>> remember_absent(["no_such_module_anywhere", "sys"])
        ['no_such_module_anywhere']
        >>> importlib.util.find_spec("no_such_module_anywhere") is None
        True
        >>> remember_absent(["no_such_module_anywhere"])  # once is enough
        []
        >>> del sys.modules["no_such_module_anywhere"]
    """
    recorded = []
    for name in names:
        if "." in name:
            raise ValueError(f"remember_absent takes top-level module names, got {name!r}.")
        if name in sys.modules:
            continue
        if importlib.util.find_spec(name) is None:
            sys.modules[name] = None
            recorded.append(name)
    return recorded
