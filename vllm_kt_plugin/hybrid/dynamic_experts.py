"""Dynamic GPU experts (KT_DYNAMIC_GPU_EXPERTS): each layer's GPU experts follow the traffic.

Picks are counted on the device (captured into CUDA graphs too); every N-th forward that runs
Python, the layer swaps its most-picked CPU experts with its least-picked GPU experts before
queuing its work: the CPU backend writes the incoming ones (unquantized), a shadow of the
layer puts them through vLLM's loader and post-processing, and they are copied into the
outgoing experts' GPU slots in place. Nothing is reallocated (captured graphs stay valid) and
every pick is computed once, on one side; counts halve at each refresh (docs/design.md).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from vllm_kt_plugin.hybrid.contracts import Forward, ForwardObserver
from vllm_kt_plugin.hybrid.shadow import shadow_layer
from vllm_kt_plugin.hybrid.vllm_compat import DOWN_SHARD, GATE_SHARD, UP_SHARD, load_expert_weight

if TYPE_CHECKING:
    from vllm.model_executor.layers.fused_moe import RoutedExperts
    from vllm.model_executor.layers.fused_moe.fused_moe_method_base import FusedMoEMethodBase

    from vllm_kt_plugin.cpu_backends.base import CPUExperts
    from vllm_kt_plugin.hybrid.swap_log import SwapLog
    from vllm_kt_plugin.planning.placement import ExpertPlacement

DECAY = 0.5  # the counts' weight after each refresh


def swaps(counts: torch.Tensor, gpu_mask: torch.Tensor) -> list[tuple[int, int]]:
    """(CPU expert in, GPU expert out) pairs: the most-picked CPU experts against the
    least-picked GPU experts, as long as the CPU one was picked more (ties stay put)."""
    cpu = sorted(torch.nonzero(~gpu_mask).flatten().tolist(), key=lambda e: -float(counts[e]))
    gpu = sorted(torch.nonzero(gpu_mask).flatten().tolist(), key=lambda e: float(counts[e]))
    pairs = []
    for incoming, outgoing in zip(cpu, gpu, strict=False):
        if counts[incoming] <= counts[outgoing]:
            break
        pairs.append((incoming, outgoing))
    return pairs


class DynamicExperts(ForwardObserver):
    """One layer's routing counts and expert swaps (see the module docstring); it observes
    the layer's forwards: a refresh (outside CUDA-graph capture) before the forward's work
    is queued, then the forward's picks counted."""

    def __init__(
        self,
        layer_name: str,
        placement: ExpertPlacement,
        gpu_slot_of: torch.Tensor,
        cpu: CPUExperts,
        make_native: Callable[[RoutedExperts], FusedMoEMethodBase],
        create_args: dict[str, Any],
        every: int,
        swap_log: SwapLog,
    ) -> None:
        self.layer_name = layer_name
        self.placement = placement
        self.gpu_slot_of = gpu_slot_of  # on the device, read by the forward (and captured graphs)
        self.slots = gpu_slot_of.cpu()  # the host's view of the same map
        self.cpu = cpu
        self.make_native = make_native
        self.create_args = create_args
        self.every = every
        self.swap_log = swap_log  # the process's
        # Built after loading, inside vLLM's config context; swaps run at forward time,
        # where vLLM's layer code (the shadow's native method) needs it set again.
        from vllm.config import get_current_vllm_config

        self.vllm_config = get_current_vllm_config()
        self.counts = torch.zeros(placement.num_experts, dtype=torch.float32, device=gpu_slot_of.device)
        self.forwards = 0
        self.swapped = 0  # experts moved to the GPU so far, for the log and tests

    def routed(self, forward: Forward) -> None:
        if not forward.capturing:
            self.maybe_refresh(forward.layer)
        self.observe(forward.topk_ids)

    def observe(self, topk_ids: torch.Tensor) -> None:
        """Count this forward's picks (graph-safe: fixed shapes, no host sync). Padded
        tokens' picks are -1 (vLLM's VLLM_MOE_SKIP_PADDING) and count for nothing."""
        ids = topk_ids.reshape(-1).long()
        self.counts.index_add_(0, ids.clamp_min(0), (ids >= 0).to(torch.float32))

    def maybe_refresh(self, layer: RoutedExperts) -> None:
        """Every ``every``-th call: swap experts where the counts say so."""
        self.forwards += 1
        if self.forwards % self.every:
            return
        counts = self.counts.cpu()
        self.counts.mul_(DECAY)
        pairs = swaps(counts, self.placement.gpu_mask)
        if not pairs:
            return
        started = time.perf_counter()  # the copies from pageable host memory block until done
        rows = self._native_format(layer, [expert for expert, _ in pairs])
        self._check_rows(layer, rows)  # before any slot is overwritten
        for row, (expert, outgoing) in enumerate(pairs):
            self._swap(layer, rows, row, expert, outgoing)
        self.gpu_slot_of.copy_(self.slots.to(self.gpu_slot_of.device))
        self.cpu.set_gpu_experts(self.placement.gpu_mask)
        self.swapped += len(pairs)
        self.swap_log.add(self.layer_name, pairs, time.perf_counter() - started)

    def _check_rows(self, layer: RoutedExperts, rows: dict[str, torch.Tensor]) -> None:
        for name, tensor in rows.items():
            slot_shape = getattr(layer, name).shape[1:]
            if slot_shape != tensor.shape[1:]:
                raise RuntimeError(
                    f"{self.layer_name}: incoming experts came out of the native post-processing as "
                    f"{name} {list(tensor.shape[1:])}, the layer's slots are {list(slot_shape)}"
                )

    def _swap(self, layer: RoutedExperts, rows: dict[str, torch.Tensor], row: int, expert: int, outgoing: int) -> None:
        """Row ``row`` of ``rows`` (expert ``expert``) into ``outgoing``'s GPU slot."""
        slot = int(self.slots[outgoing])
        for name, tensor in rows.items():
            getattr(layer, name).data[slot].copy_(tensor[row])
        self.placement.gpu_mask[expert] = True
        self.placement.gpu_mask[outgoing] = False
        self.slots[expert] = slot
        self.slots[outgoing] = -1

    def _native_format(self, layer: RoutedExperts, experts: list[int]) -> dict[str, torch.Tensor]:
        """``experts`` as the layer's parameters hold experts, one row each: written by the
        CPU backend, then loaded and post-processed by vLLM's code on a shadow of as many
        experts — one shadow per refresh, not per expert: building and post-processing it
        is most of a swap's host time."""
        n = len(experts)
        hidden = self.create_args["hidden_size"]
        width = self.create_args["intermediate_size_per_partition"]
        w13 = torch.empty(n, 2 * width, hidden, dtype=torch.bfloat16)
        w2 = torch.empty(n, hidden, width, dtype=torch.bfloat16)
        self.cpu.write_gpu_layout(experts, {"w13_weight": w13, "w2_weight": w2})
        from vllm.config import set_current_vllm_config

        with set_current_vllm_config(self.vllm_config), torch.device("cpu"):
            shadow, native = shadow_layer(layer, n, self.make_native)
            native.create_weights(shadow, num_experts=n, **self.create_args)
            for row in range(n):  # the shadow's own ids (no expert map: check_layer_supported)
                loaded = [
                    load_expert_weight(shadow, "w13_weight", w13[row, :width], "w13_weight", GATE_SHARD, row),
                    load_expert_weight(shadow, "w13_weight", w13[row, width:], "w13_weight", UP_SHARD, row),
                    load_expert_weight(shadow, "w2_weight", w2[row], "w2_weight", DOWN_SHARD, row),
                ]
                if not all(loaded):
                    raise RuntimeError(f"{self.layer_name}: vLLM's loader took no weights for incoming row {row}")
            native.process_weights_after_loading(shadow)
        return {name: param.data for name, param in shadow.named_parameters(recurse=False)}
