"""One description of the machine's CPU.

The cost curve's cache key and the benchmark's report both name the machine they measured on;
both take it from here.
"""

from __future__ import annotations

import functools
import platform


@functools.lru_cache(maxsize=1)
def cpu_model() -> str:
    """The CPU's model name (Linux: /proc/cpuinfo), else what `platform` knows."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"

