"""The package's one compiled part: the onnxruntime custom-op library of ortspec.Q4Gemm, Q8Gemm
and CacheAttention (runtime/ort/_q4kernel.c and the headers it includes), built by pip as an extension module and loaded by
onnxruntime, never imported (runtime/ort/kernels.py). Everything else is in pyproject.toml."""

import platform

from setuptools import Extension, setup

X86 = platform.machine().lower() in ("x86_64", "amd64")
# the kernels pick AVX2, AVX-512 VNNI or AMX per function at run time; the file itself is baseline
setup(ext_modules=[Extension("ortspec.runtime.ort._q4kernel", sources=["runtime/ort/_q4kernel.c"],
                             depends=["runtime/ort/q4_simd.h", "runtime/ort/q4_amx.h", "runtime/ort/attention_simd.h",
                                      "runtime/ort/attention_kv.h", "runtime/ort/ort_abi.h",
                                      "runtime/ort/product_ops.h", "runtime/ort/attention_ops.h"],
                             extra_compile_args=["-O3"] if X86 else [], optional=True)])
