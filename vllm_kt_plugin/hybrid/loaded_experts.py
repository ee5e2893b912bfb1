"""A layer's CPU experts as vLLM's own loader writes them, for a CPU backend that takes
them so (``CPUExperts.takes_loaded_experts``: the torch backend). A shadow of the layer
(``shadow``) sized for the CPU experts gets the native method's unquantized parameters;
every checkpoint tensor of a CPU expert goes through the layer's own expert loader into its
row, so the backend sees the experts exactly as vLLM's kernels would (per-expert or fused
tensors, transposed, gate and up interleaved, biases) without code of ours per model;
gpt-oss, which copies a whole stack of experts into a parameter, gives each side its rows
(``rows_in_slot_order``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from vllm_kt_plugin.hybrid.shadow import shadow_layer
from vllm_kt_plugin.hybrid.vllm_compat import load_expert_weight

if TYPE_CHECKING:
    from vllm.model_executor.layers.fused_moe import RoutedExperts
    from vllm.model_executor.layers.fused_moe.fused_moe_method_base import FusedMoEMethodBase


class LoadedExperts:
    def __init__(
        self,
        layer: RoutedExperts,
        num_experts: int,
        make_native: Callable[[RoutedExperts], FusedMoEMethodBase],
        create_args: dict[str, Any],
    ) -> None:
        self.shadow, native = shadow_layer(layer, num_experts, make_native)
        with torch.device("cpu"):
            native.create_weights(self.shadow, num_experts=num_experts, **create_args)
        self.loaded = 0

    def load(self, param_name: str, weight: torch.Tensor, weight_name: str, shard_id: str, slot: int) -> None:
        """One checkpoint tensor of the CPU expert in row ``slot``, through vLLM's loader."""
        if load_expert_weight(self.shadow, param_name, weight, weight_name, shard_id, slot):
            self.loaded += 1

    def copy_rows(self, param_name: str, rows: torch.Tensor) -> None:
        """Every CPU expert's tensor ``param_name`` at once, in CPU-slot order, already in
        the parameter's layout (a model that copies the layer's stack past the loader)."""
        getattr(self.shadow, param_name).data.copy_(rows)
        self.loaded += 1

    def tensors(self) -> dict[str, torch.Tensor]:
        return {name: param.data for name, param in self.shadow.named_parameters(recurse=False)}


def rows_in_slot_order(stack: torch.Tensor, slot_of: torch.Tensor) -> torch.Tensor:
    """The rows of ``stack`` (one per expert of the layer) of the experts that have a slot
    in ``slot_of`` (-1: none), in slot order."""
    ids = torch.nonzero(slot_of >= 0).flatten()
    return stack[ids[slot_of[ids].argsort()].to(stack.device)]
