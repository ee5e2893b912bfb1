"""MoE architectures whose experts kt-kernel cannot compute, refused from the model's config.

kt-kernel 0.7.2 computes SiLU-gated experts without biases, and weights each expert's
output by its router weight. A model whose experts do otherwise would load, then either
fail in a worker (``hybrid.moe_method.check_layer_supported`` catches what a built layer
shows) or give wrong numbers. Checked here from the Hugging Face config alone, in the
process that parses the config, so that the user reads one line before any weight loads.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from vllm_kt_plugin.settings.errors import KTConfigError

_LLAMA4 = "Llama 4 applies the router weights to the experts' input; kt-kernel weights their output"
_GPT_OSS = "gpt-oss's experts have biases and a clamped SwiGLU; kt-kernel computes SiLU-gated experts without biases"
# config.json's "architectures" entry -> why kt-kernel cannot compute its experts
REFUSED_ARCHITECTURES: Mapping[str, str] = {
    "Llama4ForCausalLM": _LLAMA4,
    "Llama4ForConditionalGeneration": _LLAMA4,
    "GptOssForCausalLM": _GPT_OSS,
}
# the same by "model_type", for configs that name no architecture (or a text config's)
REFUSED_MODEL_TYPES: Mapping[str, str] = {"llama4": _LLAMA4, "llama4_text": _LLAMA4, "gpt_oss": _GPT_OSS}


def architecture_refusal(hf_config: Mapping[str, Any]) -> str | None:
    """Why kt-hybrid cannot serve the model of this config (``config.json`` as a dict), or
    None where nothing in it is known to be unsupported."""
    for architecture in hf_config.get("architectures") or ():
        if architecture in REFUSED_ARCHITECTURES:
            return f"{architecture}: {REFUSED_ARCHITECTURES[architecture]}"
    for config in (hf_config, hf_config.get("text_config") or {}):
        model_type = config.get("model_type")
        if model_type in REFUSED_MODEL_TYPES:
            return f"model type {model_type}: {REFUSED_MODEL_TYPES[model_type]}"
    return None


def check_architecture(hf_config: Mapping[str, Any]) -> None:
    """``architecture_refusal`` as the one-line config error."""
    refusal = architecture_refusal(hf_config)
    if refusal is not None:
        raise KTConfigError(
            "--quantization",
            "kt-hybrid",
            refusal,
            "a MoE model whose experts kt-kernel computes (docs/supported_models.md lists those checked)",
        )
