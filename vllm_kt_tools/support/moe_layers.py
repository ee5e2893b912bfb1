"""Real vLLM MoE layers built as models build them (FusedMoEFactory), the single-process
vLLM world they need, and a dense float32 reference: for the tests and the layer
benchmark."""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F

HIDDEN, INTER = 128, 64
_layer_ids = itertools.count(100)
NAMES = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


def fresh_layer_index() -> int:
    """vLLM refuses two layers of one name: every test layer gets its own index."""
    return next(_layer_ids)


@contextlib.contextmanager
def vllm_world(vllm_config: Any, backend: str = "gloo") -> Iterator[Any]:
    """One-process tensor/pipeline-parallel groups under ``vllm_config``: what building a
    MoE layer outside a model needs (gloo on the CPU, nccl on CUDA).

    On the CPU, AMX tiles are asked of the kernel first, as an engine's first oneDNN matmul
    does before any MoE layer runs: vLLM's CPU MoE kernels use them and die of SIGILL in a
    process that has not asked. kt-kernel asks only from its worker threads at their first
    forward, so a layer run alone raced them (the split curve's test failed 5 times in 8)."""
    from vllm.config import set_current_vllm_config

    from vllm_kt_plugin.hybrid.vllm_compat import ask_for_amx_tiles
    from vllm_kt_tools.support.vllm_internals import init_single_process_groups

    if backend == "gloo":
        ask_for_amx_tiles()
    with set_current_vllm_config(vllm_config):
        init_single_process_groups(backend)
        yield vllm_config


def build_moe(
    quant_config: Any,
    num_experts: int = 8,
    top_k: int = 2,
    hidden: int = HIDDEN,
    inter: int = INTER,
    layer_idx: int | None = None,
    decoder_layer: str | None = None,
    **factory_args: Any,
) -> Any:
    """A MoERunner like a model's (``<decoder_layer>.mlp.experts``; by default
    ``model.layers.<layer_idx>``)."""
    from vllm.model_executor.layers.fused_moe import FusedMoEFactory

    if decoder_layer is None:
        decoder_layer = f"model.layers.{fresh_layer_index() if layer_idx is None else layer_idx}"
    return FusedMoEFactory(
        num_experts=num_experts,
        top_k=top_k,
        hidden_size=hidden,
        intermediate_size=inter,
        params_dtype=torch.bfloat16,
        renormalize=True,
        quant_config=quant_config,
        prefix=f"{decoder_layer}.mlp.experts",
        **factory_args,
    )


def random_experts(num_experts: int, seed: int, hidden: int = HIDDEN, inter: int = INTER) -> dict:
    """{expert: {"gate_proj"|"up_proj"|"down_proj": bf16 tensor}}, checkpoint layout."""
    gen = torch.Generator().manual_seed(seed)
    shapes = {"gate_proj": (inter, hidden), "up_proj": (inter, hidden), "down_proj": (hidden, inter)}
    return {
        e: {n: (torch.randn(s, generator=gen) * 0.1).to(torch.bfloat16) for n, s in shapes.items()}
        for e in range(num_experts)
    }


def checkpoint_items(experts: dict):
    """(name, tensor) as RoutedExperts.load_weights receives them."""
    return [(f"{e}.{n}.weight", t) for e, ws in experts.items() for n, t in ws.items()]


def load(runner, experts: dict) -> list[str]:
    from vllm_kt_tools.support.vllm_internals import routed_experts

    loaded = list(runner.load_weights(checkpoint_items(experts)))
    layer = routed_experts(runner)
    layer.quant_method.process_weights_after_loading(layer)
    return loaded


def reference_moe(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, experts: dict) -> torch.Tensor:
    """Dense float32 sum_k w[t,k] * expert(x[t])."""
    xf = x.float()
    out = torch.zeros_like(xf)
    for t in range(x.shape[0]):
        for k in range(topk_ids.shape[1]):
            w = experts[int(topk_ids[t, k])]
            h = F.silu(xf[t] @ w["gate_proj"].float().T) * (xf[t] @ w["up_proj"].float().T)
            out[t] += topk_weights[t, k].float() * (h @ w["down_proj"].float().T)
    return out


def random_routing(tokens: int, num_experts: int, top_k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(tokens, num_experts, generator=gen)
    weights, ids = torch.softmax(logits, -1).topk(top_k, dim=-1)
    return ids.to(torch.int32), weights / weights.sum(-1, keepdim=True)
