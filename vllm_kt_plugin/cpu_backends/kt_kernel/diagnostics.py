"""What ``vllm-kt doctor`` says about kt-kernel on this machine: how fast each method runs
on the kernel build kt-kernel loads here (one verdict per method: the measured table's time
where it has one, else whether the build has the kernel), and whether the weight files a
method reads are where kt-kernel will look. kt-kernel's layout and speeds are known here,
not in doctor, which asks each backend through ``CPUExperts.diagnose``."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from vllm_kt_plugin.cpu_backends.base import ERROR, OK, WARN, Diagnostic
from vllm_kt_plugin.cpu_backends.kt_kernel.gguf_files import is_gguf_path
from vllm_kt_plugin.cpu_backends.kt_kernel.method_speeds import (
    DECODE_BATCH,
    NOISE_RATIO,
    MethodSpeed,
    gguf_hint,
    ranking,
    source,
)
from vllm_kt_plugin.cpu_backends.kt_kernel.methods import (
    QUANTIZES_ONLINE,
    broken_kernel,
    kernel_available,
)
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
# What each measured method starts from, for the methods line.
_READS = {
    "BF16": "reads a BF16 checkpoint",
    "AMXINT4": "quantized from a BF16 checkpoint at the first start",
    "AMXINT8": "quantized from a BF16 checkpoint at the first start",
}


def cpu_features(flags: frozenset[str]) -> str:
    have = {
        "AMX": flags >= AMX_FLAGS,
        "AVX-512": flags >= AVX512_FLAGS,
        "AVX-512-BF16": "avx512_bf16" in flags,
        "AVX2": "avx2" in flags,
    }
    return ", ".join(f"{name} {'yes' if present else 'no'}" for name, present in have.items())


@dataclass(frozen=True)
class KernelBuild:
    """The kt-kernel build (CPU variant) this machine loads: its measured rows that run
    (fastest at batch-1 decode first) and why the methods that cannot run do not."""

    variant: str
    measured: tuple[MethodSpeed, ...]
    cannot_run: Mapping[str, str]  # KT_METHOD -> why

    def verdict(self, method: str) -> tuple[str, str]:
        """One verdict on ``method`` here (level, text): from its measured time where the
        table has one (WARN where the fastest is clearly faster), else whether this build
        has the kernel (ERROR where not)."""
        if method in self.cannot_run:
            return ERROR, f"cannot run here: {self.cannot_run[method]}"
        row = next((s for s in self.measured if s.method == method), None)
        if row is None:
            return OK, f"runs here; not measured ({NOT_MEASURED})"
        level, relative = self.relative(row)
        fastest = self.measured[0]
        than = "" if row is fastest else f"; the fastest: {fastest.row}, {fastest.batch_ms[DECODE_BATCH]:.2f} ms"
        which = f"{row.row}: " if row.row != method else ""  # LLAMAFILE: its fastest GGUF type's row
        return level, f"{which}{row.batch_ms[DECODE_BATCH]:.2f} ms a layer at batch {DECODE_BATCH}, {relative}{than}"

    def relative(self, row: MethodSpeed) -> tuple[str, str]:
        """``row`` against the fastest row at batch-1 decode: OK within the noise, else WARN."""
        fastest = self.measured[0]
        if row is fastest:
            return OK, "the fastest here"
        ratio = row.batch_ms[DECODE_BATCH] / fastest.batch_ms[DECODE_BATCH]
        if ratio < NOISE_RATIO:
            return OK, f"{ratio:.1f}x the fastest's time, within the measurement's noise"
        return WARN, f"{ratio:.1f}x the fastest's time"


NOT_MEASURED = "the table times the methods that start from a BF16 checkpoint or GGUF"


def build_of(variant: str, cannot_run: Mapping[str, str]) -> KernelBuild:
    measured = tuple(s for s in ranking(variant) if s.method not in cannot_run)
    return KernelBuild(variant, measured, dict(cannot_run))


def loaded_build() -> KernelBuild:
    """The build kt-kernel loads here (KTConfigError where it does not load)."""
    from vllm_kt_plugin.cpu_backends.kt_kernel.compat import prepare_kt_kernel

    variant = str(prepare_kt_kernel().__cpu_variant__)
    cannot_run = {}
    for method in KT_METHODS:
        if method == "SYCL_GPTQ_INT4":
            cannot_run[method] = "an Intel GPU (SYCL) kernel, not a CPU one"
        elif broken_kernel(method):
            cannot_run[method] = str(broken_kernel(method))
        elif not kernel_available(method):
            cannot_run[method] = f"no kernel in kt-kernel's {variant} build"
    return build_of(variant, cannot_run)


def check_cpu(method: str | None, flags: frozenset[str]) -> Diagnostic:
    """The CPU, the kt-kernel build it loads, and KT_METHOD's verdict on that build (the
    same verdict as its row on the methods line)."""
    features = cpu_features(flags)
    if "avx2" not in flags:
        return Diagnostic("cpu", ERROR, f"{features}: no AVX2, so kt-kernel has no kernels for this CPU")
    try:
        build = loaded_build()
    except KTConfigError as e:
        return Diagnostic("cpu", WARN, f"{features}; kt-kernel does not load: {e}")
    loads = f"{features}: kt-kernel loads its {build.variant} build"
    if method is None:
        return Diagnostic("cpu", OK, f"{loads} (the methods line rates each method on it)")
    level, verdict = build.verdict(method)
    return Diagnostic("cpu", level, f"{loads}; KT_METHOD={method}: {verdict}")


def fastest_here(weight_path: str | None = None) -> Diagnostic:
    """Every method's verdict on the build this CPU loads, fastest first, from the measured
    table (``method_speeds``); what KT_METHOD=auto picks among them, and where the fastest
    reads GGUF and ``weight_path`` holds none, what to point KT_WEIGHT_PATH at."""
    try:
        build = loaded_build()
    except KTConfigError as e:
        return Diagnostic("methods", WARN, f"not known: {e}")
    has_gguf = bool(weight_path and is_gguf_path(weight_path))
    lines = [
        f"ms per decode step at batch 1 / 16 on kt-kernel's {build.variant} build, fastest first "
        f"(measured: {source()}):"
    ]
    if not build.measured:
        lines.append(f"  no measured row for kt-kernel's {build.variant} build")
    width = max((len(s.row) for s in build.measured), default=0)
    for row in build.measured:
        times = " / ".join(f"{ms:.2f}" for ms in row.batch_ms.values())
        needs = _READS.get(row.method, "")
        if row.method == "LLAMAFILE" and not has_gguf:
            needs = gguf_hint(row) if row is build.measured[0] else f"reads a {row.gguf_type} GGUF"
        lines.append(f"  {row.row:<{width}}  {times:>15}  {build.relative(row)[1]}" + (f"; {needs}" if needs else ""))
    measured = {s.method for s in build.measured}
    unmeasured = [m for m in KT_METHODS if m not in measured and m not in build.cannot_run]
    if unmeasured:
        lines.append(f"  runs here, not measured ({NOT_MEASURED}): {', '.join(unmeasured)}")
    reasons: dict[str, list[str]] = {}
    for method, why in build.cannot_run.items():
        reasons.setdefault(why, []).append(method)
    lines += [f"  cannot run here: {', '.join(methods)}: {why}" for why, methods in reasons.items()]
    lines.append(
        "  KT_METHOD=auto picks the fastest the weights allow; `vllm-kt doctor --measure-methods` measures this machine"
    )
    return Diagnostic("methods", OK, "\n".join(lines))


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
