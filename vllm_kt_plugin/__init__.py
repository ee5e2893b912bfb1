"""vllm-kt-plugin: kt-kernel CPU experts inside unmodified vLLM (``--quantization kt-hybrid``).

Importing this package registers nothing. vLLM calls :func:`register` in each of its
processes through the ``vllm.general_plugins`` entry point (name ``kt_hybrid``, so
``VLLM_PLUGINS`` can leave it out). The entry point ``kt_cpu_router`` calls
:func:`register_cpu_router`: only the fix of vLLM's CPU router, nothing of kt-hybrid.
"""

from __future__ import annotations

__version__ = "0.1.0"

_registered = False


def register() -> None:
    """Register the ``kt-hybrid`` quantization method with vLLM, and let KT_* settings
    travel to Ray workers as vLLM's own VLLM_* do (its Ray executor copies variables by
    prefix; a worker on another host would otherwise start with none). Cheap and
    idempotent: it imports vLLM's quantization registry, its Ray environment list (not
    Ray) and our config class. A process that dies of a refused KT_* setting ends its
    output with that one line."""
    global _registered
    if _registered:
        return
    from vllm.model_executor.layers.quantization import register_quantization_config

    from vllm_kt_plugin.hybrid.quant_config import QUANT_NAME, KTHybridConfig
    from vllm_kt_plugin.hybrid.serve_checks import print_config_errors_last
    from vllm_kt_plugin.hybrid.vllm_compat import let_ray_workers_inherit, route_ungrouped_sigmoid_on_cpu
    from vllm_kt_plugin.settings.catalogue import SETTINGS_PREFIX

    register_quantization_config(QUANT_NAME)(KTHybridConfig)
    let_ray_workers_inherit(SETTINGS_PREFIX)
    route_ungrouped_sigmoid_on_cpu()
    print_config_errors_last()
    _registered = True


def register_cpu_router() -> None:
    """Only let vLLM's CPU build route sigmoid top-k without expert groups (MiniMax-M2,
    Laguna; ``vllm_compat.route_ungrouped_sigmoid_on_cpu``), registering nothing of
    kt-hybrid: the model check's plain-vLLM reference loads it alone, where its recipe
    says the architecture needs it. Idempotent."""
    from vllm_kt_plugin.hybrid.vllm_compat import route_ungrouped_sigmoid_on_cpu

    route_ungrouped_sigmoid_on_cpu()
