"""vllm-kt-plugin: kt-kernel CPU experts inside unmodified vLLM (``--quantization kt-hybrid``).

Importing this package registers nothing. vLLM calls :func:`register` in each of its
processes through the ``vllm.general_plugins`` entry point (name ``kt_hybrid``, so
``VLLM_PLUGINS`` can leave it out).
"""

from __future__ import annotations

__version__ = "0.1.0"

_registered = False


def register() -> None:
    """Register the ``kt-hybrid`` quantization method with vLLM. Cheap and idempotent:
    it imports only vLLM's quantization registry and our config class."""
    global _registered
    if _registered:
        return
    from vllm.model_executor.layers.quantization import register_quantization_config

    from vllm_kt_plugin.hybrid.quant_config import QUANT_NAME, KTHybridConfig

    register_quantization_config(QUANT_NAME)(KTHybridConfig)
    _registered = True
