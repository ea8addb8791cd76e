"""The install builds ortspec's kernel library wherever it can run. setup.py marks the extension
optional (a machine without a C compiler still installs, and exports onnxruntime's kernels), so a
compile error in runtime/ort/*.h would otherwise pass unnoticed: the package would install, and
every test of the kernels would skip. On a Linux x86-64 CPU with AVX2 and FMA and a C compiler,
the library must be there and pick the best kernel the CPU's flags allow."""

from __future__ import annotations

import platform
import shutil
from pathlib import Path

import pytest

from ortspec.runtime.ort import kernels


def _cpu_flags() -> set[str]:
    """The flags of /proc/cpuinfo's first processor; empty where there is no such file."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


FLAGS = _cpu_flags()


@pytest.mark.skipif(platform.machine().lower() not in ("x86_64", "amd64")
                    or not {"avx2", "fma"} <= FLAGS or shutil.which("cc") is None,
                    reason="the kernel library is built for Linux x86-64 CPUs with AVX2 and FMA, "
                           "by a C compiler")
def test_pip_built_the_kernel_library_and_it_runs_the_best_kernel_of_this_cpu():
    assert kernels.library_path() is not None, \
        "pip did not build runtime/ort/_q4kernel.c (pip install -v -e . shows the compiler's error)"
    assert kernels.available()
    if {"avx512f", "avx512bw", "avx512vl", "avx512_vnni"} <= FLAGS:
        assert kernels.isa() >= 2, kernels.ISA_NAMES[kernels.isa()]
    else:
        assert kernels.isa() == 1, kernels.ISA_NAMES[kernels.isa()]
