"""MoE architectures whose experts kt-kernel cannot compute, known from the model's config.

Checked from the Hugging Face config alone, in the process that parses the config, so
that a configuration no backend can serve (KT_BACKEND set to a backend that cannot
compute them, or a quantized checkpoint: the torch backend computes unquantized experts
only) stops with one line before any weight loads. Which layers go to the torch backend,
and what ``hybrid.backend_choice`` adds: docs/design.md."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from vllm_kt_plugin.settings.errors import KTConfigError

_LLAMA4 = "Llama 4 applies the router weights to the experts' input; kt-kernel weights their output"
_GPT_OSS = "gpt-oss's experts have biases and a clamped SwiGLU; kt-kernel computes SiLU-gated experts without biases"
# config.json's "architectures" entry -> what kt-kernel cannot compute of its experts
KT_KERNEL_CANNOT: Mapping[str, str] = {
    "Llama4ForCausalLM": _LLAMA4,
    "Llama4ForConditionalGeneration": _LLAMA4,
    "GptOssForCausalLM": _GPT_OSS,
}
# the same by "model_type", for configs that name no architecture (or a text config's)
KT_KERNEL_CANNOT_TYPES: Mapping[str, str] = {"llama4": _LLAMA4, "llama4_text": _LLAMA4, "gpt_oss": _GPT_OSS}
TORCH = "torch"


def kt_kernel_cannot(hf_config: Mapping[str, Any]) -> str | None:
    """What kt-kernel cannot compute of this model's experts (``config.json`` as a dict), or
    None where nothing in it is known to be beyond kt-kernel."""
    for architecture in hf_config.get("architectures") or ():
        if architecture in KT_KERNEL_CANNOT:
            return f"{architecture}: {KT_KERNEL_CANNOT[architecture]}"
    for config in (hf_config, hf_config.get("text_config") or {}):
        model_type = config.get("model_type")
        if model_type in KT_KERNEL_CANNOT_TYPES:
            return f"model type {model_type}: {KT_KERNEL_CANNOT_TYPES[model_type]}"
    return None


def architecture_refusal(
    hf_config: Mapping[str, Any], backend: str | None = None, quantization: str | None = None
) -> str | None:
    """Why no CPU backend can serve this model as configured, or None. ``backend``: KT_BACKEND
    where the user set it (None: unset, the plugin picks); ``quantization``: the
    checkpoint's quantization method (None: unquantized)."""
    cannot = kt_kernel_cannot(hf_config)
    if cannot is None:
        return None
    if backend is not None and backend != TORCH:
        return f"{cannot}; KT_BACKEND={backend} cannot compute them (KT_BACKEND=torch or unset can)"
    if quantization is not None:
        return f"{cannot}; and the torch backend computes unquantized experts only, this checkpoint is {quantization}"
    return None


def check_architecture(
    hf_config: Mapping[str, Any], backend: str | None = None, quantization: str | None = None
) -> None:
    """``architecture_refusal`` as the one-line config error."""
    refusal = architecture_refusal(hf_config, backend, quantization)
    if refusal is not None:
        raise KTConfigError(
            "--quantization",
            "kt-hybrid",
            refusal,
            "a MoE model whose experts a CPU backend computes (docs/supported_models.md)",
        )
