"""Skip markers for tests that need a kernel this CPU may lack: kt-kernel's AMXINT4 and
AMXINT8 kernels need AVX-512 (AMX is faster); machines with AVX2 only cannot run them
at all, so those tests are reported as skipped there, with the reason."""

from __future__ import annotations

import importlib.util

import pytest

from vllm_kt_plugin.cpu_backends.kt_kernel.methods import kernel_available, kt_inference_methods


def kt_kernel_installed() -> bool:
    return importlib.util.find_spec("kt_kernel") is not None


def _has_kernel(method: str) -> bool:
    if not kt_kernel_installed():
        return False
    kt_inference_methods()  # imports kt-kernel with the CPU-only workarounds first
    return kernel_available(method)


def requires_kernel(method: str) -> pytest.MarkDecorator:
    """Skip where kt-kernel, or its ``method`` kernel, is missing (reason given)."""
    if not kt_kernel_installed():
        return pytest.mark.skip(reason="kt-kernel is not installed")
    return pytest.mark.skipif(
        not _has_kernel(method),
        reason=f"this CPU's kt-kernel build ({kt_variant()}) has no {method} kernel (needs AVX-512 or AMX)",
    )


def skip_without_kernel(method: str) -> None:
    """Inside a test whose method is a parameter: skip (reason given) where kt-kernel, or
    its ``method`` kernel, is missing; the one check ``requires_kernel`` also makes."""
    pytest.importorskip("kt_kernel")
    if not _has_kernel(method):
        from vllm_kt_plugin.cpu_backends.kt_kernel.methods import broken_kernel

        why = broken_kernel(method) or f"this CPU's build ({kt_variant()}) has no {method} kernel"
        pytest.skip(f"kt-kernel: {why}")


def kernel_family() -> str:
    """kt-kernel's loaded kernels as their rounding differs: ``amx``, ``avx512`` (any of its
    AVX-512 builds) or ``avx2``."""
    variant = kt_variant()
    return "avx512" if variant.startswith("avx512") else variant


def kt_variant() -> str:
    kt_kernel = pytest.importorskip("kt_kernel")
    return str(kt_kernel.__cpu_variant__)
