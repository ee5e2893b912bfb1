"""What ``vllm-kt doctor`` says about kt-kernel on this machine: which methods its
kernels run fast, slowly or not at all on this CPU, and whether the weight files a method
reads are where kt-kernel will look. kt-kernel's layout and speeds are known here, not in
doctor, which asks each backend through ``CPUExperts.diagnose``."""

from __future__ import annotations

from vllm_kt_plugin.cpu_backends.base import ERROR, OK, WARN, Diagnostic
from vllm_kt_plugin.cpu_backends.kt_kernel.gguf_files import is_gguf_path
from vllm_kt_plugin.cpu_backends.kt_kernel.method_speeds import gguf_hint, ranking, source
from vllm_kt_plugin.cpu_backends.kt_kernel.methods import QUANTIZES_ONLINE, kernel_available
from vllm_kt_plugin.cpu_backends.kt_kernel.weight_paths import (
    Checkpoint,
    check_default,
    check_model_directory,
    check_weight_path,
)
from vllm_kt_plugin.settings.catalogue import KT_METHODS
from vllm_kt_plugin.settings.errors import KTConfigError
from vllm_kt_plugin.settings.model_memory import ExpertShape

AMX_FLAGS = frozenset({"amx_tile", "amx_int8"})
AVX512_FLAGS = frozenset({"avx512f", "avx512bw"})


def cpu_features(flags: frozenset[str]) -> str:
    have = {
        "AMX": flags >= AMX_FLAGS,
        "AVX-512": flags >= AVX512_FLAGS,
        "AVX-512-BF16": "avx512_bf16" in flags,
        "AVX2": "avx2" in flags,
    }
    return ", ".join(f"{name} {'yes' if present else 'no'}" for name, present in have.items())


def method_speed(method: str, flags: frozenset[str]) -> str:
    """fast, slow or impossible: how kt-kernel runs ``method`` on a CPU with ``flags``.
    AMX methods are fast with AMX tiles, slow on AVX-512; the others are fast with AVX-512
    (BF16: with avx512_bf16) and slow with AVX2 alone."""
    avx512 = flags >= AVX512_FLAGS
    if method in QUANTIZES_ONLINE:
        return "fast" if flags >= AMX_FLAGS else "slow" if avx512 else "impossible"
    if method == "SYCL_GPTQ_INT4":
        return "impossible"  # an Intel GPU (SYCL) kernel, not a CPU one
    if method == "FP8_PERCHANNEL" and not avx512:
        return "impossible"  # kt-kernel 0.7.2 ships it for AVX-512 only
    if "avx2" not in flags:
        return "impossible"
    if method == "BF16" and "avx512_bf16" not in flags:
        return "slow"
    return "fast" if avx512 else "slow"


def check_cpu_capabilities(flags: frozenset[str]) -> Diagnostic:
    """With no KT_METHOD to check: what this CPU runs, per method."""
    speeds: dict[str, list[str]] = {"fast": [], "slow": [], "impossible": []}
    for method in KT_METHODS:
        speeds[method_speed(method, flags)].append(method)
    level = OK if speeds["fast"] else WARN if speeds["slow"] else ERROR
    listed = "; ".join(f"{speed} here: {', '.join(methods) or 'none'}" for speed, methods in speeds.items())
    return Diagnostic("cpu", level, f"{cpu_features(flags)}. KT_METHOD {listed}")


def check_cpu(method: str | None, flags: frozenset[str]) -> Diagnostic:
    if method is None:
        return check_cpu_capabilities(flags)
    if method in QUANTIZES_ONLINE:
        if flags >= AMX_FLAGS:
            return Diagnostic("cpu", OK, f"AMX present for KT_METHOD={method}")
        if flags >= AVX512_FLAGS:
            return Diagnostic(
                "cpu",
                WARN,
                f"no AMX (amx_tile, amx_int8): kt-kernel runs KT_METHOD={method} with its AVX-512 kernels, "
                "correct but much slower than on an AMX CPU (Intel Sapphire Rapids or newer)",
            )
        return Diagnostic(
            "cpu",
            ERROR,
            f"KT_METHOD={method} needs AMX or at least AVX-512, which this CPU lacks; use a method with AVX2 "
            "kernels (BF16, FP8, GPTQ_INT4, ...) or LLAMAFILE",
        )
    if flags >= AVX512_FLAGS:
        if method == "BF16" and "avx512_bf16" not in flags:
            return Diagnostic("cpu", WARN, "AVX-512 without avx512_bf16: kt-kernel's BF16 experts take a slower path")
        return Diagnostic("cpu", OK, f"AVX-512{' with BF16' if 'avx512_bf16' in flags else ''} for KT_METHOD={method}")
    if "avx2" in flags:
        return Diagnostic("cpu", WARN, f"AVX2 only: kt-kernel's AVX2 kernels for KT_METHOD={method} are much slower")
    return Diagnostic("cpu", ERROR, "no AVX2: kt-kernel has no kernels for this CPU")


def fastest_here(weight_path: str | None = None) -> Diagnostic:
    """The fastest method for the kt-kernel variant this CPU loads, from the measured table
    (``method_speeds``): what KT_METHOD=auto picks where the weights allow it; where it reads
    GGUF and ``weight_path`` holds none, what to point KT_WEIGHT_PATH at."""
    from vllm_kt_plugin.cpu_backends.kt_kernel.compat import prepare_kt_kernel

    try:
        variant = str(prepare_kt_kernel().__cpu_variant__)
    except KTConfigError as e:
        return Diagnostic("fastest", WARN, f"not known: {e}")
    ranked = [s for s in ranking(variant) if kernel_available(s.method)]
    if not ranked:
        return Diagnostic("fastest", WARN, f"no measured row for kt-kernel's {variant} kernels ({source()})")
    order = "; then ".join(s.describe() for s in ranked[1:])
    best = ranked[0]
    missing = best.method == "LLAMAFILE" and not (weight_path and is_gguf_path(weight_path))
    return Diagnostic(
        "fastest",
        OK,
        f"kt-kernel loads its {variant} kernels here: fastest decode {best.describe()}"
        + (f" ({gguf_hint(best)})" if missing else "")
        + f"; then {order} (KT_METHOD=auto picks the fastest the weights allow; measured: {source()}; "
        "`vllm-kt doctor --measure-methods` measures this machine)",
    )


def check_weights(
    method: str | None,
    weight_path: str | None,
    model_dir: str | None,
    *,
    pools: int = 1,
    checkpoint: Checkpoint | None = None,
    shape: ExpertShape | None = None,
    variant: str | None = None,
) -> Diagnostic:
    """Serve's weight checks (weight_paths.py), with serve's line where it would refuse;
    the ``checkpoint`` and the experts' ``shape`` where doctor read the model's config."""
    if method is None:
        return Diagnostic("weights", WARN, "KT_METHOD unknown; not checked")
    try:
        if weight_path is not None:
            held = check_weight_path(
                method, weight_path, pools=pools, checkpoint=checkpoint, model=shape, variant=variant
            )
            every = "" if shape is not None else " (pass --model DIR to check every layer against the model)"
            return Diagnostic("weights", OK, f"KT_METHOD={method} reads {weight_path}: {held.describe()}{every}")
        refusal = check_default(method, checkpoint or Checkpoint(own_method=method))
        if refusal is not None:
            return Diagnostic("weights", ERROR, str(refusal))
        if method in QUANTIZES_ONLINE:
            return Diagnostic(
                "weights",
                OK,
                f"KT_WEIGHT_PATH unset: {method} experts are quantized online into KT_CACHE_DIR at first start",
            )
        if model_dir is None:
            return Diagnostic("weights", WARN, f"KT_WEIGHT_PATH unset; pass --model DIR to check the {method} weights")
        check_model_directory(method, model_dir, shape)
        return Diagnostic("weights", OK, f"KT_METHOD={method} reads the model directory {model_dir}")
    except KTConfigError as e:
        return Diagnostic("weights", ERROR, str(e))
