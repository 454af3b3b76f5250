"""What the benchmarks record about the machine they ran on, beside their numbers."""
from __future__ import annotations

import platform

__all__ = ["cpu_model"]


def cpu_model() -> str:
    """The CPU's model name (Linux ``/proc/cpuinfo``; else ``platform.processor()``): a VM's host
    changes between runs, and a run on another CPU model does not compare with this one."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()
