"""kt-kernel 0.7.2's methods: which read a Hugging Face checkpoint, which quantize online,
which sizes they tile, which kernels this CPU's build carries. One home for these facts:
the backend, ``vllm-kt doctor`` and the planning code read them here.
"""

from __future__ import annotations

from vllm_kt_plugin.cpu_backends.kt_kernel.compat import prepare_kt_kernel
from vllm_kt_plugin.settings.catalogue import KT_GPU_LAYOUT_WRITERS

# Methods whose weights kt-kernel reads straight from a Hugging Face checkpoint's
# safetensors, so KT_WEIGHT_PATH can default to the model directory.
READS_HF_CHECKPOINT = frozenset({"BF16", "FP8", "FP8_PERCHANNEL", "GPTQ_INT4", "RAWINT4", "MXFP4", "NVFP4", "MXFP8"})
# Methods kt-kernel quantizes online from BF16 tensors (load_weights_from_tensors); it
# runs them with AMX tiles where the CPU has them, else with AVX-512.
QUANTIZES_ONLINE = frozenset({"AMXINT4", "AMXINT8"})
# kt-kernel 0.7.2's AMX kernels tile hidden and expert-intermediate sizes in these steps;
# other sizes fail ("n or k is not aligned") or crash, so they are refused up front.
ONLINE_ALIGNMENT = {"AMXINT4": 128, "AMXINT8": 64}
# kt-kernel's own availability flags (kt_kernel.utils.amx) per method: the kernels the
# loaded build carries. kt-kernel checks the same flags, but only after vLLM has loaded
# every GPU weight; we check them at config time.
KERNEL_FLAGS = {
    "AMXINT4": ("_HAS_AMXINT4_SUPPORT",),
    "AMXINT8": ("_HAS_AMXINT8_SUPPORT",),
    "BF16": ("_HAS_BF16_SUPPORT", "_HAS_AVX2_BF16_SUPPORT"),
    "FP8": ("_HAS_FP8_SUPPORT", "_HAS_AVX2_FP8_SUPPORT"),
    "FP8_PERCHANNEL": ("_HAS_FP8_PERCHANNEL_SUPPORT",),
    "RAWINT4": ("_HAS_RAWINT4_SUPPORT", "_HAS_AVX2_RAWINT4_SUPPORT", "_HAS_AVXVNNI256_RAW_INT4_SUPPORT"),
    "GPTQ_INT4": (
        "_HAS_AVX2_GPTQ_INT4_SUPPORT",
        "_HAS_AVXVNNI256_GPTQ_INT4_SUPPORT",
        "_HAS_AVXVNNI256_PACKED_GPTQ_INT4_SUPPORT",
    ),
    "SYCL_GPTQ_INT4": ("_HAS_SYCL_GPTQ_INT4_SUPPORT",),
    "MXFP4": ("_HAS_MXFP4_SUPPORT", "_HAS_AVX2_MXFP4_SUPPORT"),
    "NVFP4": ("_HAS_AVX2_MXFP4_SUPPORT",),
    "MXFP8": ("_HAS_MXFP8_SUPPORT", "_HAS_AVX2_MXFP8_SUPPORT"),
}
# MOE_INT4/MOE_INT8's flags (kt_kernel.utils.moe_kernel): kt-kernel 0.7.2's x86 wheels build
# none of them (its general kernels are the ARM KML / AOCL builds'), so its wrapper refused
# them in the worker, after vLLM had loaded the GPU weights.
MOE_KERNEL_FLAGS = {"MOE_INT4": "_HAS_INT4_SUPPORT", "MOE_INT8": "_HAS_INT8_SUPPORT"}


# Kernels a kt-kernel 0.7.2 CPU variant carries but that crash, refused like missing ones:
# (variant, method) -> what happens.
BROKEN_KERNELS = {
    ("avx2", "RAWINT4"): "its AVX2 RAWINT4 kernel crashes the process (SIGSEGV) in its first forward, at every "
    "shape tried (hidden 128 to 7168, groups of 32 and 128)",
}


def broken_kernel(method: str) -> str | None:
    """Why the loaded kt-kernel variant's ``method`` kernel cannot be used, if it is broken."""
    import kt_kernel

    return BROKEN_KERNELS.get((str(kt_kernel.__cpu_variant__), method))


def kt_inference_methods() -> frozenset[str]:
    prepare_kt_kernel()
    from kt_kernel.experts import INFERENCE_METHODS

    return frozenset(INFERENCE_METHODS)


def writes_gpu_layout(method: str) -> bool:
    """Whether kt-kernel can write ``method``'s experts back in the layout of vLLM's Triton
    MoE kernels (known before any layer loads: the C++ class it will pick has the task)."""
    if method not in KT_GPU_LAYOUT_WRITERS:
        return False
    from kt_kernel.utils import amx

    # kt-kernel's own preference: AMX/AVX-512 first, AVX2 else
    moe_class = (amx.AMXBF16_MOE or amx.AVX2BF16_MOE) if method == "BF16" else (amx.AMXFP8_MOE or amx.AVX2FP8_MOE)
    return hasattr(moe_class, "write_weight_scale_to_buffer_task")


def kernel_available(method: str) -> bool:
    """Whether the kt-kernel build this CPU loaded carries a working kernel for ``method``."""
    if broken_kernel(method) is not None:
        return False
    if method in MOE_KERNEL_FLAGS:
        from kt_kernel.utils import moe_kernel

        return bool(getattr(moe_kernel, MOE_KERNEL_FLAGS[method], False))
    flags = KERNEL_FLAGS.get(method)
    if flags is None:
        return True
    from kt_kernel.utils import amx

    return any(getattr(amx, flag, True) for flag in flags)
