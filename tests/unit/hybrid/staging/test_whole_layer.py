"""The whole-layer path (``hybrid/staging/whole_layer.py``) on real vLLM MoE layers: forwards
from the plan's size compute every CPU expert from the staged host copy, smaller ones take the
CPU path; both match the dense reference."""

from __future__ import annotations

import pytest
import torch
from kt_testing.hybrid_layers import E, K, assert_close, kt_config

from vllm_kt_plugin.hybrid.staging.build import staging_path
from vllm_kt_plugin.hybrid.staging.whole_layer import WholeLayerPath
from vllm_kt_tools.support.moe_layers import (
    HIDDEN,
    build_moe,
    load,
    random_experts,
    random_routing,
    reference_moe,
)


@pytest.mark.parametrize("num_gpu", [0, 3])
def test_whole_layer_matches_dense_reference(vllm_layer_context, num_gpu: int) -> None:
    """KT_STAGING_MIN_TOKENS: a batch at the threshold computes the CPU experts with the
    native method from the staged host copy (loaded through vLLM's expert loader); a
    smaller one goes to the CPU backend. Both match the dense reference."""
    runner = build_moe(kt_config(kt_backend="torch", kt_num_gpu_experts=str(num_gpu), kt_staging_min_tokens="12"))
    layer = runner.routed_experts
    method = layer.quant_method
    experts = random_experts(E, seed=10 + num_gpu)
    load(runner, experts)
    prefill = staging_path(method.paths)
    assert isinstance(prefill, WholeLayerPath)
    assert prefill.host is not None and len(prefill.host.cpu_expert_ids) == E - num_gpu and prefill.host.copies
    staged_before = prefill.buffers.uses
    for tokens, staged in ((11, 0), (12, 1), (40, 1)):
        x = torch.randn(tokens, HIDDEN, generator=torch.Generator().manual_seed(tokens)).to(torch.bfloat16)
        ids, weights = random_routing(tokens, E, K, seed=tokens)
        out = method.apply(layer, x, weights, ids, None, None)
        assert_close(out, reference_moe(x, ids, weights, experts))
        assert prefill.buffers.uses == staged_before + staged, tokens
        staged_before = prefill.buffers.uses
