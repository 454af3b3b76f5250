"""Makes ``compare_pool`` importable from the benchmark tests under any ``--import-mode``."""
import os
import sys
import warnings

_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)

# TorchRL warns about its multiprocessing exchange default; the benchmarks always pass it.
warnings.filterwarnings("ignore", category=FutureWarning, module="torchrl")
