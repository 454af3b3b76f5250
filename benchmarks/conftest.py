"""Makes ``compare_pool`` importable from the benchmark tests under any ``--import-mode``."""
import os
import sys
import warnings

_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)

# TorchRL warns about its multiprocessing exchange default; the benchmarks always pass it.
warnings.filterwarnings("ignore", category=FutureWarning, module="torchrl")


def pytest_collection_modifyitems(config, items):
    """TorchRL's collectors take minutes to start: their cells run only when ``-m`` names them."""
    import pytest

    if "torchrl" in (config.getoption("markexpr") or ""):
        return
    skip = pytest.mark.skip(reason="TorchRL collector cell: select with -m torchrl")
    for item in items:
        if "torchrl" in item.keywords and item.get_closest_marker("torchrl") is not None:
            item.add_marker(skip)
