"""Shadows of a vLLM MoE layer: a copy that shares the layer's configuration and routing
state but owns its parameters, sized for a number of experts of our choosing. vLLM's own
code (the native method's create_weights, the layer's expert weight loader, the native
post-processing) then builds experts in the layer's runtime format away from the layer:
GPU prefill's host copy, and the incoming experts that dynamic GPU experts write into
GPU slots.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import TYPE_CHECKING

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
    shadow = copy.copy(layer)
    shadow._parameters = {}
    shadow._buffers = dict(layer._buffers)  # the expert map and other routing state
    shadow._modules = {}
    shadow.moe_config = copy.copy(layer.moe_config)
    shadow.moe_config.num_local_experts = num_experts
    if moe_backend is not None:
        shadow.moe_config.moe_backend = moe_backend
    shadow.local_num_experts = num_experts
    native = make_native(shadow)
    object.__setattr__(shadow, "quant_method", native)  # nn.Module's setattr would register it
    return shadow, native
