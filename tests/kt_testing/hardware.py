"""Skip markers for tests that need a kernel this CPU may lack: kt-kernel's AMXINT4 and
AMXINT8 kernels need AVX-512 (AMX is faster); machines with AVX2 only cannot run them
at all, so those tests are reported as skipped there, with the reason."""

from __future__ import annotations

import pytest

from vllm_kt_plugin.cpu_backends.kt_kernel.methods import kernel_available, kt_inference_methods


def _has_kernel(method: str) -> bool:
    kt_inference_methods()  # imports kt-kernel with the CPU-only workarounds first
    return kernel_available(method)


def requires_kernel(method: str) -> pytest.MarkDecorator:
    return pytest.mark.skipif(
        not _has_kernel(method),
        reason=f"this CPU's kt-kernel build ({kt_variant()}) has no {method} kernel (needs AVX-512 or AMX)",
    )


def kt_variant() -> str:
    import kt_kernel

    return str(kt_kernel.__cpu_variant__)
