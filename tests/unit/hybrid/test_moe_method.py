"""The kt-hybrid MoE method (``hybrid/moe_method.py``) on real vLLM MoE layers (built by
FusedMoEFactory, loaded through vLLM's expert weight loader), against a dense float32 reference
and plain vLLM."""

from __future__ import annotations

import pytest
import torch
from kt_testing.hybrid_layers import (
    REFERENCE_BOUND,
    E,
    K,
    assert_close,
    expert_numel,
    forward,
    hybrid_layer,
    kt_config,
    relative_error,
)

from vllm_kt_plugin.hybrid.loaded_experts import rows_in_slot_order
from vllm_kt_plugin.hybrid.moe_method import KTHybridMoEMethod
from vllm_kt_plugin.planning.placement import ExpertPlacement
from vllm_kt_tools.support.moe_layers import (
    HIDDEN,
    INTER,
    build_moe,
    checkpoint_items,
    fresh_layer_index,
    load,
    random_experts,
    random_routing,
    reference_moe,
)


@pytest.mark.parametrize("num_gpu", [0, 1, 3, 8])
def test_torch_backend_matches_dense_reference(vllm_layer_context, num_gpu: int) -> None:
    runner = build_moe(kt_config(kt_backend="torch", kt_num_gpu_experts=str(num_gpu)))
    layer = runner.routed_experts
    assert isinstance(layer.quant_method, KTHybridMoEMethod)
    experts = random_experts(E, seed=num_gpu)
    load(runner, experts)
    x = torch.randn(16, HIDDEN, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    ids, weights = random_routing(16, E, K, seed=2)
    out = layer.quant_method.apply(layer, x, weights, ids, None, None)
    assert_close(out, reference_moe(x, ids, weights, experts))


def test_the_hybrid_layer_matches_plain_vllm(vllm_layer_context) -> None:
    """Router, scaling and the combine stay vLLM's: same layer output as without kt-hybrid."""
    experts = random_experts(E, seed=7)
    plain = build_moe(None)
    hybrid = build_moe(kt_config(kt_backend="torch", kt_num_gpu_experts="3"))
    load(plain, experts)
    load(hybrid, experts)
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(32, HIDDEN, generator=gen).to(torch.bfloat16)
    logits = torch.randn(32, E, generator=gen).to(torch.bfloat16)
    from vllm.forward_context import set_forward_context

    with set_forward_context(None, vllm_layer_context):
        expected = plain._forward_impl(x, logits, None)
        got = hybrid._forward_impl(x, logits, None)
    assert_close(got, expected.float())


@pytest.mark.parametrize("num_gpu", [0, 2, 5, 8])
def test_device_memory_scales_with_gpu_experts(vllm_layer_context, num_gpu: int) -> None:
    runner = build_moe(kt_config(kt_backend="torch", kt_num_gpu_experts=str(num_gpu)))
    per_expert = 2 * INTER * HIDDEN + HIDDEN * INTER
    assert expert_numel(runner.routed_experts) == num_gpu * per_expert


def test_cpu_expert_tensors_never_reach_the_layer(vllm_layer_context) -> None:
    """GPU experts land in their slots; CPU experts' tensors go to the CPU backend only."""
    runner = build_moe(kt_config(kt_backend="torch", kt_num_gpu_experts="3"))
    layer = runner.routed_experts
    method = layer.quant_method
    seen: list[int] = []
    load_cpu = method.cpu.load_checkpoint_tensor
    method.cpu.load_checkpoint_tensor = lambda e, s, t: (seen.append(e), load_cpu(e, s, t))
    experts = random_experts(E, seed=11)
    loaded = list(runner.load_weights(checkpoint_items(experts)))
    assert sorted(set(loaded)) == ["routed_experts.w13_weight", "routed_experts.w2_weight"]
    assert sorted(set(seen)) == [3, 4, 5, 6, 7]
    for slot, expert in enumerate([0, 1, 2]):
        assert torch.equal(layer.w2_weight[slot], experts[expert]["down_proj"])
        assert torch.equal(layer.w13_weight[slot, :INTER], experts[expert]["gate_proj"])


def test_a_stack_copied_past_the_loader_reaches_both_sides(vllm_layer_context, monkeypatch: pytest.MonkeyPatch) -> None:
    """gpt-oss's loader copies each layer's stack of all experts straight into the parameter
    (``param.copy_``): the GPU experts' rows land in their slots, the CPU experts' rows reach
    the torch backend, and the layer computes what the dense reference does."""
    placement = ExpertPlacement.from_gpu_expert_ids(E, [1, 4, 6])
    monkeypatch.setattr(ExpertPlacement, "first_n", classmethod(lambda cls, n, k: placement))
    runner = build_moe(kt_config(kt_backend="torch", kt_num_gpu_experts="3"))
    layer = runner.routed_experts
    experts = random_experts(E, seed=13)
    w13 = torch.stack([torch.cat([experts[e]["gate_proj"], experts[e]["up_proj"]]) for e in range(E)])
    w2 = torch.stack([experts[e]["down_proj"] for e in range(E)])
    layer.w13_weight.copy_(w13)
    layer.w2_weight.copy_(w2)
    assert layer.quant_method.loaded_cpu_experts.loaded == 2
    assert torch.equal(layer.w2_weight.data, w2[[1, 4, 6]])
    layer.quant_method.process_weights_after_loading(layer)
    assert "copy_" not in layer.w13_weight.__dict__  # copies are the tensor's own again
    x = torch.randn(16, HIDDEN, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    ids, weights = random_routing(16, E, K, seed=2)
    out = layer.quant_method.apply(layer, x, weights, ids, None, None)
    assert_close(out, reference_moe(x, ids, weights, experts))


def test_rows_in_slot_order() -> None:
    stack = torch.arange(6).view(6, 1)
    slot_of = torch.tensor([-1, 2, -1, 0, 1, -1])
    assert rows_in_slot_order(stack, slot_of).flatten().tolist() == [3, 4, 1]
    assert rows_in_slot_order(stack, torch.full((6,), -1)).shape == (0, 1)


def test_any_subset_of_experts_can_be_on_the_gpu(vllm_layer_context, monkeypatch: pytest.MonkeyPatch) -> None:
    placement = ExpertPlacement.from_gpu_expert_ids(E, [1, 4, 6])
    monkeypatch.setattr(ExpertPlacement, "first_n", classmethod(lambda cls, n, k: placement))
    runner = build_moe(kt_config(kt_backend="torch", kt_num_gpu_experts="3"))
    layer = runner.routed_experts
    experts = random_experts(E, seed=5)
    list(runner.load_weights(checkpoint_items(experts)))
    assert torch.equal(layer.w2_weight[1], experts[4]["down_proj"])  # expert 4 -> GPU slot 1
    layer.quant_method.process_weights_after_loading(layer)
    x = torch.randn(16, HIDDEN, generator=torch.Generator().manual_seed(9)).to(torch.bfloat16)
    ids, weights = random_routing(16, E, K, seed=4)
    assert_close(layer.quant_method.apply(layer, x, weights, ids, None, None), reference_moe(x, ids, weights, experts))


def test_deferral_only_into_a_following_hybrid_layer(vllm_layer_context) -> None:
    """KT_MAX_DEFERRED_EXPERTS_PER_TOKEN reaches kt-kernel only where the next decoder
    layer is a kt-hybrid layer that adds the deferred experts (never on the last one)."""
    config = kt_config(kt_max_deferred_experts_per_token="1", kt_num_gpu_experts="2")
    first = fresh_layer_index()
    assert [fresh_layer_index() for _ in range(3)] == [first + 1, first + 2, first + 3]  # reserved
    methods = [build_moe(config, layer_idx=i).routed_experts.quant_method for i in (first, first + 1, first + 3)]
    assert [m._deferral() for m in methods] == [1, 0, 0]


def test_the_compiled_op_finds_its_layer_in_the_forward_context(vllm_layer_context, fresh_process_state) -> None:
    """``torch.ops.vllm_kt.hybrid_moe`` (what torch.compile calls on vLLM's CPU build)
    finds the layer by name as vLLM's moe_forward does, and computes the same output."""
    from vllm.forward_context import set_forward_context

    layer, experts = hybrid_layer(KT_NUM_GPU_EXPERTS="3")
    eager, x, ids, weights = forward(layer, 8, seed=5)
    with set_forward_context(None, vllm_layer_context):
        op = torch.ops.vllm_kt.hybrid_moe(x, weights, ids, layer.layer_name)
    assert torch.equal(op, eager)
    error = relative_error(op, reference_moe(x, ids, weights, experts))
    print(f"the op, 8 tokens: relative error {error:.4f}")
    assert error <= REFERENCE_BOUND
