"""Whether and how a layer stages its CPU experts on the GPU: ``plan_staging(facts)``.

One pure decision (no torch, no vLLM). Each stage asks it with what it knows: serve's
config-time checks and doctor (the settings and the checkpoint), planning (the GPU's and
the host's memory), and each layer once (the kernel vLLM chose, its device and CUDA
graphs, planning's plan). A fact not known yet refuses nothing; a set value that cannot
apply is ``StagingPlan.refused``, and ``auto`` that cannot turn on says why.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm_kt_plugin.settings.catalogue import (
    AUTO,
    BLOCK_FP8,
    GIB,
    KT_GPU_LAYOUT_WRITERS,
    UNQUANTIZED,
    WHOLE_LAYER_AUTO_MIN_TOKENS,
)
from vllm_kt_plugin.settings.errors import KTConfigError
from vllm_kt_plugin.settings.model_memory import ModelMemory
from vllm_kt_plugin.settings.variables import KTSettings

# How a forward computes a layer's CPU experts: the names of the paths, the metrics' log
# lines and the timeline.
CPU_PATH = "CPU-experts"  # all on the CPU
SPLIT_PATH = "split"  # a part staged on the GPU, the rest on the CPU
WHOLE_LAYER_PATH = "whole-layer"  # every one staged on the GPU
OFF = "off"  # a plan that stages nothing: every forward takes the CPU path

NO_CUDA_DEVICE = "no CUDA device"  # why auto is off on vLLM's CPU build (said nowhere: it is the norm there)

# auto leaves staging off where its two GPU buffers (each a whole layer's CPU experts, all
# experts at worst) would take more than this share of the granted GPU memory: the GPU
# experts they displace would slow every decode step ...
MAX_BUFFERS_SHARE_OF_GPU = 0.125
# ... or where its host copy and kt-kernel's experts would take more than this share of RAM.
MAX_SHARE_OF_RAM = 0.9

# KT_STAGING_FP8_COPY=auto: the CPU methods whose own drift from BF16 CPU experts is at least
# the FP8 copy's drift from the exact copy (docs/split.md, "Settings"): with them the copy adds
# no more error than the CPU experts carry.
FP8_COPY_AUTO_METHODS = ("AMXINT4",)
FP8_MIN_CAPABILITY = (8, 9)  # FP8 tensor cores: Ada and Hopper on
FP8_BLOCK = 128  # rows and columns of a block of the FP8 copy (kt-kernel's and DeepSeek's)

BLOCK_FP8_RULE = "staging takes block-FP8 experts as kt-kernel's FP8 writes them back, under CUDA, whole"


@dataclass(frozen=True)
class StagingFacts:
    """What the decision reads. ``None``: not known where it is asked (then nothing that
    depends on it is refused)."""

    settings: KTSettings
    experts: str | None = None  # the format staging would copy: UNQUANTIZED, BLOCK_FP8, or what else
    quantized: str | None = None  # what quantized the experts (None: BF16/FP16), for the FP8 copy
    tensor_parallel_size: int | None = None
    device: str | None = None  # "cuda" or "cpu"
    capability: tuple[int, int] | None = None  # the CUDA device's (None without one)
    cpu_experts: int | None = None  # per layer
    computes_cpu_experts: bool = True  # this rank runs the CPU backend (tensor-parallel rank 0)
    backend_writes: bool | None = None  # the CPU backend writes its experts in the GPU layout
    cpu_block_fp8_moe: bool | None = None  # vLLM's CPU build runs block-FP8 MoE here (AMX)
    expert_widths: tuple[int, int] | None = None  # (hidden, intermediate)
    cuda_graph_sizes: tuple[int, ...] = ()
    memory: ModelMemory | None = None  # the model's sizes, with the GPU's granted bytes:
    granted_gpu_bytes: float | None = None  # auto's room for the buffers
    gpu_experts: int | None = None  # with the RAM available: auto's room for the host copy
    ram_available_bytes: int | None = None
    off_because: str | None = None  # why planning left auto off for the model


@dataclass(frozen=True)
class StagingPlan:
    """The decision: ``path`` (OFF, WHOLE_LAYER_PATH or SPLIT_PATH) for forwards of at least
    ``min_tokens`` tokens, the split's ``share`` (None: the cost model picks per forward)
    and whether the host copy is block FP8."""

    path: str = OFF
    min_tokens: int = 0
    share: float | None = None
    fp8_copy: bool = False
    why_off: str | None = None  # why auto stays off
    notes: tuple[str, ...] = ()  # what the layer says once in the log
    refused: KTConfigError | None = field(default=None, compare=False)  # a set value that cannot apply

    def check(self) -> StagingPlan:
        """This plan, or the refusal of a setting that cannot apply."""
        if self.refused is not None:
            raise self.refused
        return self


def plan_staging(facts: StagingFacts) -> StagingPlan:
    """The staging of one layer (or of every layer, where the facts are the model's)."""
    s = facts.settings
    asked, auto = s.staging_min_tokens, s.staging_min_tokens is AUTO
    if s.dynamic_gpu_experts and not auto and asked:
        return _refused(
            "KT_DYNAMIC_GPU_EXPERTS",
            str(s.dynamic_gpu_experts),
            f"KT_STAGING_MIN_TOKENS={asked} is set too: staging stages a fixed set of CPU experts",
            "0, or KT_STAGING_MIN_TOKENS unset or 0 (auto turns staging off with dynamic experts)",
        )
    if s.staging_fp8_copy is True and asked == 0:
        return _refused(
            "KT_STAGING_FP8_COPY",
            "1",
            "KT_STAGING_MIN_TOKENS=0 turns staging off, so there is no copy",
            "0 (or unset) with staging off; with KT_STAGING_MIN_TOKENS auto or a number, the FP8 copy",
        )
    if s.staging_fp8_copy is True and facts.quantized is not None:
        return _fp8_copy_refused(
            f"the FP8 host copy quantizes BF16/FP16 experts, and this checkpoint's are already quantized "
            f"({facts.quantized})"
        )
    if asked == 0 or facts.cpu_experts == 0:
        return StagingPlan()
    if auto and s.dynamic_gpu_experts:
        return _off("KT_DYNAMIC_GPU_EXPERTS moves experts, staging stages a fixed set")
    refusal = staging_refusal(
        facts.experts,
        s.method if isinstance(s.method, str) else "",
        facts.tensor_parallel_size,
        device=facts.device,
        backend_writes=facts.backend_writes,
        backend=s.backend,
    )
    # the copy's format first: auto's RAM room depends on it
    fp8_copy, fp8_note, fp8_refused = _fp8_copy(facts, refusal)
    if fp8_refused is not None:
        return _fp8_copy_refused(fp8_refused)
    tp = facts.tensor_parallel_size or 1
    if s.staging_split is not AUTO and tp > 1:
        return _refused(
            "KT_STAGING_SPLIT",
            str(s.staging_split),
            f"the split stages whole experts: one tensor-parallel rank, not {tp}",
            "auto with --tensor-parallel-size > 1",
        )
    # the split stages whole experts (one rank's) and leaves the rest to this rank's CPU backend
    splits = tp == 1 and facts.computes_cpu_experts and (auto or s.staging_split is not AUTO)
    if not auto:
        if refusal is not None:  # refused where there are CPU experts to stage (known)
            if facts.cpu_experts is None:
                return StagingPlan(why_off=refusal)
            return _refused("KT_STAGING_MIN_TOKENS", str(asked), refusal, "0 (off) for this checkpoint")
        least = int(asked)  # type: ignore[arg-type]
    else:
        why = (
            facts.off_because
            or (NO_CUDA_DEVICE if facts.device not in (None, "cuda") else None)
            or refusal
            or _no_room(facts, fp8_copy)
        )
        if why is not None:
            return _off(why)
        least = 1 if splits else WHOLE_LAYER_AUTO_MIN_TOKENS  # 1: the cost model decides each forward
    notes = (fp8_note,) if fp8_note else ()
    graphs = facts.cuda_graph_sizes
    if graphs and least <= graphs[-1]:
        if least > 1:
            notes += (
                f"KT_STAGING_MIN_TOKENS={least} raised to {graphs[-1] + 1}: batches up to {graphs[-1]} tokens "
                "replay CUDA graphs",
            )
        least = graphs[-1] + 1  # captured batches replay the CPU path: no Python runs there
    share = None if s.staging_split is AUTO else float(s.staging_split)  # type: ignore[arg-type]
    return StagingPlan(SPLIT_PATH if splits else WHOLE_LAYER_PATH, least, share, fp8_copy, notes=notes)


def _off(why: str) -> StagingPlan:
    notes = () if why == NO_CUDA_DEVICE else (f"staging (KT_STAGING_MIN_TOKENS=auto) off: {why}",)
    return StagingPlan(why_off=why, notes=notes)


def _refused(variable: str, value: str, reason: str, allowed: str) -> StagingPlan:
    return StagingPlan(why_off=reason, refused=KTConfigError(variable, value, reason, allowed))


def _fp8_copy_refused(why: str) -> StagingPlan:
    return _refused("KT_STAGING_FP8_COPY", "1", why, "0 for this checkpoint")


def staging_refusal(
    experts: str | None,
    kt_method: str,
    tensor_parallel_size: int | None = 1,
    *,
    device: str | None = None,
    backend_writes: bool | None = None,
    backend: str = "",
) -> str | None:
    """Why CPU experts stored as ``experts`` (``UNQUANTIZED``, ``BLOCK_FP8``, or a description
    of another format or kernel) cannot be staged with ``kt_method``, or None; facts not
    known (None) refuse nothing."""
    if experts is None or experts == UNQUANTIZED:
        return None
    if experts != BLOCK_FP8:
        return (
            "staging takes unquantized experts run by vLLM's Triton (or CPU) MoE kernels and block-FP8 ones; "
            f"this checkpoint's experts are {experts}"
        )
    if KT_GPU_LAYOUT_WRITERS.get(kt_method.upper()) != BLOCK_FP8:
        return f"{BLOCK_FP8_RULE}: KT_METHOD=FP8 (this checkpoint's default), not {kt_method}"
    if tensor_parallel_size is not None and tensor_parallel_size > 1:
        return f"{BLOCK_FP8_RULE}: one tensor-parallel rank, not --tensor-parallel-size {tensor_parallel_size}"
    if device is not None and device != "cuda":
        return f"{BLOCK_FP8_RULE}: a CUDA device, not {device}"
    if backend_writes is False:
        return f"{BLOCK_FP8_RULE}: KT_BACKEND={backend} (this build) cannot write its FP8 experts back"
    return None


def _fp8_copy(facts: StagingFacts, refusal: str | None) -> tuple[bool, str | None, str | None]:
    """KT_STAGING_FP8_COPY for these facts: whether the copy is block FP8, what to say of
    auto's choice, and why 1 cannot apply (``refusal``: why nothing can be staged)."""
    s = facts.settings
    if s.staging_fp8_copy is False:
        return False, None, None
    if s.staging_fp8_copy is True:
        tp, widths = facts.tensor_parallel_size or 1, facts.expert_widths
        why = refusal
        if why is None and tp > 1:
            why = f"it quantizes whole experts: one tensor-parallel rank, not {tp}"
        if why is None and facts.device == "cpu" and facts.cpu_block_fp8_moe is False:
            why = "vLLM's CPU build runs block-FP8 MoE only on AMX CPUs, and this one has no AMX"
        if why is None and facts.device == "cpu" and widths is not None and any(w % FP8_BLOCK for w in widths):
            # vLLM 0.32 refines narrower experts' blocks (64 x 64), which its CPU kernel does not take
            why = (
                f"vLLM's CPU build runs block-FP8 MoE with {FP8_BLOCK} x {FP8_BLOCK} blocks only, and this layer's "
                f"experts are {widths[0]} x {widths[1]}"
            )
        return why is None, None, why
    if facts.device is None:
        return False, None, None  # auto is decided where the device is known
    method = s.method if isinstance(s.method, str) else ""
    why = fp8_copy_refusal(
        method,
        quantized=facts.quantized is not None or facts.experts not in (None, UNQUANTIZED),
        tensor_parallel_size=facts.tensor_parallel_size or 1,
        capability=facts.capability,
    )
    if why is None:
        said = f"KT_STAGING_FP8_COPY=auto: {method} CPU experts on a GPU with FP8; 0 keeps the checkpoint's format"
        return True, f"the host copy is block FP8 ({said})", None
    if facts.capability is None:
        return False, None, None
    return False, f"the host copy keeps the checkpoint's format (FP8 copy auto: {why})", None


def fp8_copy_refusal(
    kt_method: str, *, quantized: bool, tensor_parallel_size: int, capability: tuple[int, int] | None
) -> str | None:
    """Why KT_STAGING_FP8_COPY=auto leaves the host copy in the checkpoint's format, or None
    where auto makes it block FP8. ``capability``: the CUDA device's, None without one."""
    if capability is None:
        return "no CUDA device"
    if tuple(capability) < FP8_MIN_CAPABILITY:
        return f"the GPU (compute capability {capability[0]}.{capability[1]}) has no FP8 tensor cores"
    if quantized:
        return "the checkpoint's experts are quantized already"
    if tensor_parallel_size > 1:
        return f"it quantizes whole experts: one tensor-parallel rank, not {tensor_parallel_size}"
    if kt_method.upper() not in FP8_COPY_AUTO_METHODS:
        return (
            f"KT_METHOD={kt_method}'s CPU experts are more accurate than the FP8 copy would be (auto turns it on "
            f"for {' and '.join(FP8_COPY_AUTO_METHODS)})"
        )
    return None


# --- auto's room: the GPU's and the host's memory -------------------------------------


def buffer_bytes(memory: ModelMemory, gpu_experts: int, tensor_parallel_size: int = 1) -> float:
    """The two GPU staging buffers, each one layer's CPU experts."""
    return 2 * (memory.num_experts - gpu_experts) * memory.expert_bytes / max(1, tensor_parallel_size)


def buffers_fit(memory: ModelMemory, granted_bytes: float, tensor_parallel_size: int = 1) -> bool:
    """Whether auto's buffers (all experts on the CPU at worst) stay within their share."""
    return buffer_bytes(memory, 0, tensor_parallel_size) <= MAX_BUFFERS_SHARE_OF_GPU * granted_bytes


def host_copy_bytes(
    memory: ModelMemory, gpu_experts: int, kt_method: str, tensor_parallel_size: int = 1, fp8_copy: bool = False
) -> int:
    """RAM staging keeps: every layer's CPU experts in the checkpoint's format (in block FP8
    with ``fp8_copy``); where kt-kernel writes them back, two pinned buffers of one layer's
    CPU experts instead; none where they cannot be staged."""
    if staging_refusal(memory.checkpoint_format, kt_method, tensor_parallel_size) is not None:
        return 0
    cpu_experts = memory.num_experts - gpu_experts
    if fp8_copy and not memory.quantized:
        return cpu_experts * memory.num_moe_layers * fp8_expert_bytes(memory)
    layers = 2 if memory.written_back(kt_method) else memory.num_moe_layers
    return cpu_experts * layers * memory.expert_bytes


def fp8_expert_bytes(memory: ModelMemory) -> int:
    """One expert in block FP8: a byte a weight, plus a float32 scale per block (partial
    blocks rounded up: an upper bound)."""
    return memory.expert_params + 4 * (-(-memory.expert_params // (FP8_BLOCK * FP8_BLOCK)) + 3)


def _no_room(facts: StagingFacts, fp8_copy: bool) -> str | None:
    memory, tp = facts.memory, facts.tensor_parallel_size or 1
    if memory is None:
        return None
    granted = facts.granted_gpu_bytes
    if granted is not None and not buffers_fit(memory, granted, tp):
        return (
            f"its staging buffers (2 layers of experts, {_gb(buffer_bytes(memory, 0, tp))} GB) would take more than "
            f"{MAX_BUFFERS_SHARE_OF_GPU:.1%} of the {_gb(granted)} GB granted on the GPU"
        )
    ram, gpu_experts = facts.ram_available_bytes, facts.gpu_experts
    if ram is None or gpu_experts is None:
        return None
    method = facts.settings.method if isinstance(facts.settings.method, str) else ""
    need = host_copy_bytes(memory, gpu_experts, method, tp, fp8_copy) + (memory.cpu_expert_bytes(method) or 0)
    if need > MAX_SHARE_OF_RAM * ram:
        return (
            f"its host copy plus kt-kernel's {method} experts need {_gb(need)} GB, more than "
            f"{MAX_SHARE_OF_RAM:.0%} of the {_gb(ram)} GB of RAM available"
        )
    return None


def _gb(num_bytes: float) -> str:
    return f"{num_bytes / GIB:.1f}"
