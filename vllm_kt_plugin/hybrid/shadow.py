"""Shadows of a vLLM MoE layer: a copy that shares the layer's configuration and routing
state but owns its parameters, sized for a number of experts of our choosing. vLLM's own
code (the native method's create_weights, the layer's expert weight loader, the native
post-processing) then builds experts in the layer's runtime format away from the layer:
staging's host copy, and the incoming experts that dynamic GPU experts write into
GPU slots.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from vllm_kt_plugin.hybrid.vllm_compat import attach_quant_method, bare_copy

if TYPE_CHECKING:
    from vllm.model_executor.layers.fused_moe import RoutedExperts
    from vllm.model_executor.layers.fused_moe.fused_moe_method_base import FusedMoEMethodBase


def shadow_layer(
    layer: RoutedExperts,
    num_experts: int,
    make_native: Callable[[RoutedExperts], FusedMoEMethodBase],
    moe_backend: str | None = None,
) -> tuple[RoutedExperts, FusedMoEMethodBase]:
    """A shadow of ``layer`` for ``num_experts`` experts, with its own instance of the
    native method (which sizes itself by ``moe_config.num_local_experts``, hence a copy of
    that too), on vLLM's ``moe_backend`` where given (else the layer's choice); no weights
    created yet."""
    shadow = bare_copy(layer, num_experts, moe_backend)
    native = make_native(shadow)
    attach_quant_method(shadow, native)
    return shadow, native
