"""What ``vllm serve --quantization kt-hybrid`` refuses at config time, in one place.

vLLM builds the quant config in its API-server process (``VllmConfig``) and calls
``maybe_update_config`` with the model's config there, before the engine core starts:
every check that needs only the settings, the checkpoint's format and the model's
config.json runs then, so a mistake stops serve in seconds, not after a worker loaded
the weights. ``vllm-kt doctor --model M`` runs this same code (``check_serving``), so
doctor passes exactly what serve accepts.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from vllm_kt_plugin.architectures import TORCH, check_architecture, kt_kernel_cannot
from vllm_kt_plugin.cpu_backends.base import CheckpointFormat
from vllm_kt_plugin.cpu_backends.registry import backend_class
from vllm_kt_plugin.hybrid.staging.plan import StagingFacts, plan_staging
from vllm_kt_plugin.hybrid.vllm_compat import resolve_native_method_name, routed_expert_counts
from vllm_kt_plugin.planning.gpu_budget import fixed_num_gpu_experts
from vllm_kt_plugin.planning.layer_plan import check_plan
from vllm_kt_plugin.settings.errors import KTConfigError
from vllm_kt_plugin.settings.loader import load_settings
from vllm_kt_plugin.settings.model_memory import ModelConfigError, estimate_model_memory, experts_format
from vllm_kt_plugin.settings.presets import load_preset
from vllm_kt_plugin.settings.variables import KTSettings, numa_node_count, usable_cores

if TYPE_CHECKING:
    from vllm_kt_plugin.cpu_backends.base import CPUExperts


def validated(settings: KTSettings, checkpoint: CheckpointFormat) -> tuple[KTSettings, type[CPUExperts]]:
    """The settings with KT_METHOD resolved for the checkpoint, and their backend, checked
    against the checkpoint's format (no model config needed yet)."""
    staging = StagingFacts(settings, experts_format(checkpoint.quant_config), checkpoint.quant_method)
    plan_staging(staging).check()  # what the settings and the checkpoint's format refuse already
    backend = backend_class(settings.backend)
    settings = backend.resolve_method(settings, checkpoint)
    backend.validate(settings, checkpoint)
    if settings.dynamic_gpu_experts and not backend.can_move_experts(settings):
        raise KTConfigError(
            "KT_DYNAMIC_GPU_EXPERTS",
            str(settings.dynamic_gpu_experts),
            f"{settings.backend} {settings.method} CPU experts cannot move to the GPU (its slots hold unquantized "
            "experts: the backend must write any expert back in BF16)",
            "0, or KT_METHOD=BF16 with KT_BACKEND=kt_kernel",
        )
    return settings, backend


def platform_has_gpu() -> bool:
    """Whether vLLM's platform here is a GPU one (vLLM's CPU build: no), read without
    initializing CUDA (the API-server process must not)."""
    from vllm.platforms import current_platform

    return not current_platform.is_cpu()


def check_model(
    settings: KTSettings, backend: type[CPUExperts], hf_config: Any, model: str, *, has_gpu: bool | None = None
) -> list[str]:
    """Every check against the model: its experts, the GPU budget's inputs, the files and
    sizes the backend needs. Raises KTConfigError; returns warnings (one line each)."""
    config = hf_config.to_dict()
    given = dict(settings.given).get("KT_BACKEND")
    check_architecture(config, settings.backend if given else None, checkpoint_format(hf_config).quant_method)
    num_experts, top_k = routed_expert_counts(hf_config)
    settings.check_model(num_experts, top_k)
    sized_to_gpu = settings.gpu_experts_auto and settings.gpu_memory_gb is None
    if sized_to_gpu and not (platform_has_gpu() if has_gpu is None else has_gpu):
        raise KTConfigError(
            "KT_NUM_GPU_EXPERTS",
            "auto",
            "auto sizes the GPU experts to the GPU, and vLLM runs on the CPU here (no GPU to measure)",
            f"a number from 0 to {num_experts}, or auto with KT_GPU_MEMORY_GB set to the GPU size",
        )
    check_plan(settings, config, num_experts)
    check_staging(settings, config, num_experts, has_gpu=platform_has_gpu() if has_gpu is None else has_gpu)
    # Experts kt-kernel cannot compute get the torch backend (hybrid.backend_choice): its
    # checks apply, not kt-kernel's (which would look for kt-kernel's expert files).
    serving = backend_class(TORCH) if kt_kernel_cannot(config) and not given else backend
    serving.check_model(settings, model, config)
    return [warning for warning in [preset_mismatch(settings, config)] if warning]


def check_staging(settings: KTSettings, config: Mapping[str, Any], num_experts: int, *, has_gpu: bool) -> None:
    """The staging plan for this checkpoint on this platform: a KT_STAGING_MIN_TOKENS set
    to a number where nothing can be staged is refused (each layer asks the same plan again,
    for the kernel vLLM chose)."""
    fixed = fixed_num_gpu_experts(settings, num_experts)  # None: auto, sized to the GPU later
    try:
        memory = estimate_model_memory(config)
    except ModelConfigError:
        return  # the layer checks it
    facts = StagingFacts(
        settings,
        experts=memory.checkpoint_format,
        device="cuda" if has_gpu else "cpu",
        cpu_experts=None if fixed is None else num_experts - fixed.num_gpu_experts,
    )
    plan_staging(facts).check()


def preset_mismatch(settings: KTSettings, config: Mapping[str, Any]) -> str | None:
    """A KT_CONFIG preset written for another model: its GPU-expert table and method notes
    were sized for that model's experts, not this one's."""
    if settings.preset is None:
        return None
    try:  # read again for its model_config; load_settings accepted it on this machine already
        preset = load_preset(Path(settings.preset), cores=usable_cores(), numa_nodes=numa_node_count())
    except KTConfigError:
        return None
    if preset.memory is None:
        return None
    try:
        memory = estimate_model_memory(config)
    except ModelConfigError:
        return None
    theirs = (preset.memory.num_experts, preset.memory.num_moe_layers, preset.memory.expert_params)
    ours = (memory.num_experts, memory.num_moe_layers, memory.expert_params)
    if theirs == ours:
        return None
    return (
        f"KT_CONFIG={preset.name} is a preset for another model ({theirs[0]} experts x {theirs[1]} MoE layers, "
        f"{theirs[2]:,} weights per expert); this model has {ours[0]} x {ours[1]}, {ours[2]:,}: its settings were "
        "not sized for it (unset KT_CONFIG, or pick this model's preset)"
    )


def checkpoint_format(hf_config: Any) -> CheckpointFormat:
    """The checkpoint's format as vLLM resolves it (e.g. gptq -> gptq_marlin where Marlin runs)."""
    quant = getattr(hf_config, "quantization_config", None)
    if not quant:
        return CheckpointFormat()
    quant = dict(quant)
    return CheckpointFormat(resolve_native_method_name(quant), quant)


def check_serving(
    env: Mapping[str, str],
    model: str,
    *,
    cores: int | None = None,
    numa_nodes: int | None = None,
    has_gpu: bool | None = None,
) -> tuple[KTSettings, list[str]]:
    """What ``vllm serve MODEL --quantization kt-hybrid`` checks before its engine core
    starts, given these KT_* variables: KTConfigError on the first refusal, else the
    resolved settings and the warnings. ``has_gpu`` replaces vLLM's platform (tests)."""
    from vllm.transformers_utils.config import get_config

    hf_config = get_config(model, trust_remote_code=False)
    settings, backend = validated(load_settings(env, cores=cores, numa_nodes=numa_nodes), checkpoint_format(hf_config))
    return settings, check_model(settings, backend, hf_config, model, has_gpu=has_gpu)


def config_error_in(exc: BaseException | None) -> KTConfigError | None:
    """The KTConfigError behind ``exc``: itself, in its chain, or inside the pydantic
    ValidationError vLLM wraps config errors in (``VllmConfig.__post_init__``)."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, KTConfigError):
            return exc
        for error in getattr(exc, "errors", lambda: [])() if type(exc).__name__ == "ValidationError" else []:
            inner = (error.get("ctx") or {}).get("error")
            if isinstance(inner, KTConfigError):
                return inner
        exc = exc.__cause__ or exc.__context__
    return None


def print_config_errors_last() -> None:
    """After the traceback of a process that dies of a refused setting, print the refusal
    once more, so the last line the user sees names the variable and the fix (vLLM ends
    such output with pydantic's traceback and its documentation link)."""
    previous = sys.excepthook
    if getattr(previous, "kt_hybrid", False):
        return

    def hook(exc_type: type[BaseException], exc: BaseException, tb: Any) -> None:
        previous(exc_type, exc, tb)
        error = config_error_in(exc)
        if error is not None:
            print(f"kt-hybrid: {error}", file=sys.stderr, flush=True)

    hook.kt_hybrid = True  # type: ignore[attr-defined]
    sys.excepthook = hook
