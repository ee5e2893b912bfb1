"""The kt-hybrid MoE method on real vLLM MoE layers (built by FusedMoEFactory, loaded
through vLLM's expert weight loader), against a dense float32 reference."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from kt_testing.hardware import kt_variant, requires_kernel, skip_without_kernel
from safetensors.torch import save_file

from vllm_kt_plugin.hybrid.contracts import Forward
from vllm_kt_plugin.hybrid.host_experts import FP8_BLOCK
from vllm_kt_plugin.hybrid.loaded_experts import rows_in_slot_order
from vllm_kt_plugin.hybrid.metrics import CPU_PATH, SPLIT_PATH
from vllm_kt_plugin.hybrid.moe_method import KTHybridMoEMethod
from vllm_kt_plugin.hybrid.quant_config import KTHybridConfig
from vllm_kt_plugin.hybrid.vllm_compat import cpu_runs_block_fp8_moe
from vllm_kt_plugin.planning.placement import ExpertPlacement, route_to_gpu_slots
from vllm_kt_plugin.settings.errors import KTConfigError
from vllm_kt_plugin.settings.loader import load_settings
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

E, K = 8, 2
# bf16 output of the native kernel plus bf16 rounding of the sum: |err| <= ~2 ulp.
ATOL_REL = 2**-7
# The FP8 host copy's layer output against the dense reference, relative to its largest value
# (vLLM's CPU build runs block-FP8 MoE only on AMX CPUs; the test skips elsewhere). Measured on
# the 2-core AMX dev box (amx_bf16, avx512_fp16; `pytest -s tests/unit/test_moe_method.py -k
# fp8_host_copy_matches`, 2026-12-05): 0.0310 with the whole layer and with the split. FP8 e4m3
# weights carry up to 2**-4 relative error each (half an ulp of 3 mantissa bits). Bound: 2**-4,
# twice the measurement.
FP8_COPY_LAYER_BOUND = 2**-4


def kt_config(**env: str) -> KTHybridConfig:
    return KTHybridConfig(settings=load_settings({k.upper(): v for k, v in env.items()}, cores=4))


def expert_numel(layer: torch.nn.Module) -> int:
    return sum(p.numel() for name, p in layer.named_parameters() if name.startswith(("w13", "w2")))


def assert_close(out: torch.Tensor, ref: torch.Tensor) -> None:
    err = (out.float() - ref).abs().max().item()
    assert err <= ATOL_REL * ref.abs().max().item() * 2, (err, ref.abs().max().item())


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


def test_whole_layer_matches_plain_vllm(vllm_layer_context) -> None:
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


def write_kt_checkpoint(directory: Path, layers: dict[int, dict]) -> None:
    """Experts of several decoder layers, named as in a Hugging Face checkpoint."""
    tensors = {
        f"model.layers.{idx}.mlp.experts.{e}.{n}.weight": t.contiguous()
        for idx, experts in layers.items()
        for e, ws in experts.items()
        for n, t in ws.items()
    }
    save_file(tensors, directory / "model.safetensors")


@pytest.mark.parametrize("num_gpu", [0, 4])
def test_kt_kernel_backend_matches_dense_reference(vllm_layer_context, tmp_path: Path, num_gpu: int) -> None:
    """Real kt-kernel BF16 experts (reading their own safetensors) in two consecutive vLLM
    layers, called in turn with one batch size: kt-kernel reuses its buffers per batch
    size and alternates them between layers, so stale results would show."""
    idx = fresh_layer_index()
    layers = {idx: random_experts(E, seed=21 + num_gpu), idx + 1: random_experts(E, seed=31 + num_gpu)}
    assert fresh_layer_index() == idx + 1
    write_kt_checkpoint(tmp_path, layers)
    config = kt_config(kt_weight_path=str(tmp_path), kt_num_gpu_experts=str(num_gpu), kt_cpuinfer="1")
    runners = {i: build_moe(config, layer_idx=i) for i in layers}
    for i, runner in runners.items():
        load(runner, layers[i])
        assert type(runner.routed_experts.quant_method.cpu).__name__ == "KTKernelExperts"
    for step in range(3):
        for i, runner in runners.items():
            layer = runner.routed_experts
            x = torch.randn(8, HIDDEN, generator=torch.Generator().manual_seed(10 * step + i)).to(torch.bfloat16)
            ids, weights = random_routing(8, E, K, seed=100 * step + i)
            out = layer.quant_method.apply(layer, x, weights, ids, None, None)
            assert_close(out, reference_moe(x, ids, weights, layers[i]))


def test_deferral_only_into_a_following_hybrid_layer(vllm_layer_context) -> None:
    """KT_MAX_DEFERRED_EXPERTS_PER_TOKEN reaches kt-kernel only where the next decoder
    layer is a kt-hybrid layer that adds the deferred experts (never on the last one)."""
    config = kt_config(kt_max_deferred_experts_per_token="1", kt_num_gpu_experts="2")
    first = fresh_layer_index()
    assert [fresh_layer_index() for _ in range(3)] == [first + 1, first + 2, first + 3]  # reserved
    methods = [build_moe(config, layer_idx=i).routed_experts.quant_method for i in (first, first + 1, first + 3)]
    assert [m._deferral() for m in methods] == [1, 0, 0]


def test_route_to_gpu_slots() -> None:
    placement = ExpertPlacement.from_gpu_expert_ids(6, [0, 2, 5])
    ids = torch.tensor([[0, 1], [2, 5], [3, 4]], dtype=torch.int32)
    weights = torch.tensor([[0.6, 0.4], [0.7, 0.3], [0.5, 0.5]])
    slots, gpu_weights = route_to_gpu_slots(ids, weights, placement.gpu_slot_of())
    assert slots.dtype == torch.int32
    assert slots.tolist() == [[0, 0], [1, 2], [0, 0]]
    assert torch.equal(gpu_weights, torch.tensor([[0.6, 0.0], [0.7, 0.3], [0.0, 0.0]]))


def test_placement_masks() -> None:
    p = ExpertPlacement.first_n(8, 3)
    assert p.gpu_mask.tolist() == [True] * 3 + [False] * 5
    assert (p.num_gpu_experts, p.num_cpu_experts, p.cpu_expert_ids()) == (3, 5, [3, 4, 5, 6, 7])
    assert p.gpu_slot_of().tolist() == [0, 1, 2, -1, -1, -1, -1, -1]
    q = ExpertPlacement.from_gpu_expert_ids(8, [7, 2])
    assert q.gpu_slot_of().tolist() == [-1, -1, 0, -1, -1, -1, -1, 1]
    assert q.describe() == "2 GPU experts [2, 7], 6 CPU experts"
    with pytest.raises(ValueError):
        ExpertPlacement.first_n(8, 9)


# AMXINT8 quantization error on these random experts: ~2 % of the output norm (FACTS:
# 0.027 at the Qwen3 shape); 6 % bounds it with room, and catches missing experts (100 %).
AMXINT8_REL_ERR = 0.06


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref).norm() / ref.norm()).item()


def run_cpu(cpu, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    cpu.submit(x, ids, weights)
    return cpu.sync(x).clone()


def online_config(cache: Path, num_gpu: int) -> KTHybridConfig:
    return kt_config(kt_method="AMXINT8", kt_cache_dir=str(cache), kt_num_gpu_experts=str(num_gpu), kt_cpuinfer="1")


@requires_kernel("AMXINT8")
def test_online_amx_weights_are_quantized_once_and_cached(vllm_layer_context, tmp_path: Path) -> None:
    """AMXINT8 without KT_WEIGHT_PATH: the layer is quantized from the tensors vLLM loads
    (GPU experts' too), cached, and a later start with another placement loads the cache."""
    from vllm_kt_plugin.cpu_backends.kt_kernel.backend import KTKernelExperts

    cache = tmp_path / "cache"
    runner = build_moe(online_config(cache, num_gpu=3))
    layer = runner.routed_experts
    method = layer.quant_method
    experts = random_experts(E, seed=41)
    load(runner, experts)
    folder = method.cpu.cache
    idx = method.cpu.spec.layer_idx
    assert folder is not None and folder.is_relative_to(cache)
    assert (folder / f"_layer_{idx}" / "vllm-kt.json").is_file()
    assert not method.cpu.wants_all_experts
    x = torch.randn(16, HIDDEN, generator=torch.Generator().manual_seed(42)).to(torch.bfloat16)
    ids, weights = random_routing(16, E, K, seed=43)
    assert rel_err(method.apply(layer, x, weights, ids, None, None), reference_moe(x, ids, weights, experts)) < (
        AMXINT8_REL_ERR
    )

    # Next start, every expert on the CPU: nothing is handed over, all 8 come from the cache.
    spec = method.cpu.spec
    everything_on_cpu = ExpertPlacement.first_n(E, 0)
    again = KTKernelExperts(type(spec)(**{**spec.__dict__, "placement": everything_on_cpu}), method.settings)
    assert again.cache == folder and not again.wants_all_experts
    marker_time = (folder / f"_layer_{idx}" / "vllm-kt.json").stat().st_mtime_ns
    again.finalize_weights(0)
    assert (folder / f"_layer_{idx}" / "vllm-kt.json").stat().st_mtime_ns == marker_time
    assert rel_err(run_cpu(again, x, ids, weights), reference_moe(x, ids, weights, experts)) < AMXINT8_REL_ERR


@requires_kernel("AMXINT8")
def test_online_amx_weights_under_dummy_load_format(vllm_layer_context, tmp_path: Path) -> None:
    """load_format=dummy hands over no tensors: the CPU experts get random weights in
    vLLM's dummy range, cached apart from real weights; a real load missing them fails."""
    from vllm_kt_plugin.cpu_backends.kt_kernel.backend import KTKernelExperts

    method = build_moe(online_config(tmp_path, num_gpu=2)).routed_experts.quant_method
    spec = type(method.cpu.spec)(**{**method.cpu.spec.__dict__, "load_format": "dummy"})
    dummy = KTKernelExperts(spec, method.settings)
    assert dummy.cache != method.cpu.cache and dummy.wants_all_experts
    dummy.finalize_weights(0)
    x = torch.randn(4, HIDDEN, generator=torch.Generator().manual_seed(44)).to(torch.bfloat16)
    ids, weights = random_routing(4, E, K, seed=45)
    out = run_cpu(dummy, x, ids, weights)
    assert torch.isfinite(out).all() and out.abs().max() > 0
    with pytest.raises(RuntimeError, match="lacked 24 of the 24 expert"):
        method.cpu.finalize_weights(0)


def test_amx_sizes_kt_kernel_cannot_tile_are_refused(
    vllm_layer_context, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """kt-kernel's AMXINT4 kernels need multiples of 128 (it fails or crashes otherwise).
    The size check runs before any kernel does, so it holds on CPUs without the kernel."""
    from vllm_kt_plugin.cpu_backends.kt_kernel import backend

    monkeypatch.setattr(backend, "kernel_available", lambda method: True)
    config = kt_config(kt_method="AMXINT4", kt_cache_dir=str(tmp_path), kt_num_gpu_experts="2")
    with pytest.raises(KTConfigError, match="multiples of 128; this model has 128 and 64"):
        build_moe(config)


def test_layers_follow_kt_expert_placement(vllm_layer_context) -> None:
    """KT_EXPERT_PLACEMENT reaches the layers vLLM builds: a seeded random subset here."""
    from vllm_kt_plugin.planning.placement import random_gpu_experts

    config = kt_config(kt_num_gpu_experts="3", kt_expert_placement="random", kt_expert_placement_seed="7")
    idx = fresh_layer_index()
    layer = build_moe(config, layer_idx=idx).routed_experts
    method = layer.quant_method
    expected = random_gpu_experts(E, 3, seed=7, layer_idx=idx)
    assert method.placement.gpu_mask.nonzero().flatten().tolist() == expected != [0, 1, 2]
    assert expert_numel(layer) == 3 * (3 * INTER * HIDDEN)


def test_auto_fits_the_gpu_experts_to_the_granted_memory(vllm_layer_context) -> None:
    """KT_NUM_GPU_EXPERTS=auto with a faked device size (KT_GPU_MEMORY_GB): the count is
    what fits beside the non-expert weights, for layers of the configured model."""
    from vllm_kt_plugin.settings.model_memory import estimate_model_memory

    memory = estimate_model_memory(vllm_layer_context.model_config.hf_config.to_dict())
    utilization = vllm_layer_context.cache_config.gpu_memory_utilization
    # Room for exactly 5 experts per layer (plus half an expert) after the non-expert weights.
    room = memory.non_expert_bytes + 5.5 * memory.num_moe_layers * memory.expert_bytes
    gib = room / utilization / 2**30
    config = kt_config(kt_num_gpu_experts="auto", kt_gpu_memory_gb=f"{gib:.9f}", kt_kv_cache_reserve_gb="0")
    method = build_moe(config, layer_idx=memory.moe_layers[0]).routed_experts.quant_method
    assert method.placement.num_gpu_experts == 5


@pytest.mark.parametrize("num_gpu", [0, 3])
def test_gpu_prefill_matches_dense_reference(vllm_layer_context, num_gpu: int) -> None:
    """KT_GPU_PREFILL_MIN_TOKENS: a batch at the threshold computes the CPU experts with the
    native method from the staged host copy (loaded through vLLM's expert loader); a
    smaller one goes to the CPU backend. Both match the dense reference."""
    runner = build_moe(kt_config(kt_backend="torch", kt_num_gpu_experts=str(num_gpu), kt_gpu_prefill_min_tokens="12"))
    layer = runner.routed_experts
    method = layer.quant_method
    experts = random_experts(E, seed=10 + num_gpu)
    load(runner, experts)
    prefill = method.gpu_prefill
    assert prefill.host is not None and len(prefill.host.cpu_expert_ids) == E - num_gpu and prefill.host.copies
    staged_before = prefill.staging.uses
    for tokens, staged in ((11, 0), (12, 1), (40, 1)):
        x = torch.randn(tokens, HIDDEN, generator=torch.Generator().manual_seed(tokens)).to(torch.bfloat16)
        ids, weights = random_routing(tokens, E, K, seed=tokens)
        out = method.apply(layer, x, weights, ids, None, None)
        assert_close(out, reference_moe(x, ids, weights, experts))
        assert prefill.staging.uses == staged_before + staged, tokens
        staged_before = prefill.staging.uses


def test_gpu_prefill_is_off_by_default(vllm_layer_context) -> None:
    runner = build_moe(kt_config(kt_backend="torch", kt_num_gpu_experts="2"))
    assert runner.routed_experts.quant_method.gpu_prefill is None


def test_staging_prefetches_the_next_layer_into_the_other_buffer() -> None:
    from types import SimpleNamespace

    from vllm_kt_plugin.hybrid.host_memory import layout_of
    from vllm_kt_plugin.hybrid.staging_buffers import StagingBuffers

    def host(value: float, experts: int) -> SimpleNamespace:
        tensors = {"w13_weight": torch.full((experts, 4, 2), value)}
        return SimpleNamespace(tensors=tensors, layout=layout_of(tensors), copies=True, num_experts=experts)

    first, second, third = host(1.0, 3), host(2.0, 2), host(3.0, 3)
    staging = StagingBuffers(torch.device("cpu"))
    for h in (first, second, third):
        staging.reserve(h)
    assert staging.numel["w13_weight"] == (3 * 4 * 2, torch.float32) and staging.nbytes == 2 * 3 * 4 * 2 * 4
    index, views = staging.acquire(first)
    assert torch.equal(views["w13_weight"], first.tensors["w13_weight"])
    staging.prefetch(second, busy=index)
    assert staging.owner == ([first, second] if index == 0 else [second, first])
    staging.release(index)
    again, views = staging.acquire(second)  # prefetched: no copy, the other buffer
    assert again == 1 - index and views["w13_weight"].shape == (2, 4, 2)
    assert torch.equal(views["w13_weight"], second.tensors["w13_weight"])
    staging.prefetch(third, busy=again)  # replaces the first layer's buffer
    assert staging.owner[index] is third and staging.uses == 2


def test_pinned_copies_own_whole_pages(monkeypatch: pytest.MonkeyPatch) -> None:
    """GPU prefill's host copy: one registration per layer, of whole pages inside the
    block's own allocation (CUDA refuses a page registered twice), holding equal copies."""
    import mmap

    from vllm_kt_plugin.hybrid import host_memory

    registered: list[tuple[int, int]] = []
    monkeypatch.setattr(
        host_memory, "pin_in_place", lambda t: registered.append((t.data_ptr(), t.numel() * t.element_size()))
    )
    tensors = {"w13_weight": torch.randn(3, 10, 7).bfloat16(), "w2_weight": torch.randn(3, 7, 5)}
    copies = host_memory.pinned_copies(tensors)
    [(start, nbytes)] = registered
    assert start % mmap.PAGESIZE == 0 and nbytes % mmap.PAGESIZE == 0
    for name, tensor in tensors.items():
        assert torch.equal(copies[name], tensor) and copies[name].dtype == tensor.dtype
        assert start <= copies[name].data_ptr() < start + nbytes
    storage = copies["w2_weight"].untyped_storage()
    assert storage.data_ptr() <= start and start + nbytes <= storage.data_ptr() + storage.nbytes()


def test_staging_writes_layers_without_a_host_copy() -> None:
    """A layer whose CPU backend writes its experts (no host copy) is written into a host
    buffer, then copied like a host copy; prefetching it writes it then."""
    from types import SimpleNamespace

    from vllm_kt_plugin.hybrid.staging_buffers import StagingBuffers

    written: list[float] = []

    def host(value: float) -> SimpleNamespace:
        layout = {
            "w13_weight": (torch.Size([2, 4, 2]), torch.float32),
            "w2_weight": (torch.Size([2, 2, 2]), torch.float32),
        }

        def write(views: dict, rows: list[int] | None = None) -> None:
            written.append(value)
            for view in views.values():
                view.fill_(value)

        return SimpleNamespace(tensors={}, layout=layout, copies=False, write=write, num_experts=2)

    first, second = host(1.0), host(2.0)
    staging = StagingBuffers(torch.device("cpu"))
    staging.reserve(first)
    index, views = staging.acquire(first)
    assert written == [1.0] and all(bool((v == 1.0).all()) for v in views.values())
    staging.prefetch(second, busy=index)
    assert written == [1.0, 2.0]
    _, views = staging.acquire(second)
    assert written == [1.0, 2.0] and all(bool((v == 2.0).all()) for v in views.values())


def test_kt_kernel_writes_bf16_experts_in_the_gpu_layout(vllm_layer_context, tmp_path: Path) -> None:
    """kt-kernel's BF16 experts written back (GPU prefill without a host copy) are the
    checkpoint's: w13 = gate then up, w2 = down, in the order asked."""
    skip_without_kernel("BF16")
    idx = fresh_layer_index()
    experts = random_experts(E, seed=41)
    write_kt_checkpoint(tmp_path, {idx: experts})
    runner = build_moe(kt_config(kt_weight_path=str(tmp_path), kt_num_gpu_experts="2", kt_cpuinfer="1"), layer_idx=idx)
    load(runner, experts)
    cpu = runner.routed_experts.quant_method.cpu
    if not cpu.writes_gpu_layout:
        pytest.skip(f"this CPU's kt-kernel build ({kt_variant()}) cannot write BF16 experts back")
    inter, hidden = experts[0]["gate_proj"].shape
    ids = [5, 2, 7]
    w13 = torch.zeros(len(ids), 2 * inter, hidden, dtype=torch.bfloat16)
    w2 = torch.zeros(len(ids), hidden, inter, dtype=torch.bfloat16)
    cpu.write_gpu_layout(ids, {"w13_weight": w13, "w2_weight": w2})
    for row, expert in enumerate(ids):
        assert torch.equal(w13[row], torch.cat([experts[expert]["gate_proj"], experts[expert]["up_proj"]]))
        assert torch.equal(w2[row], experts[expert]["down_proj"])
    # kt-kernel writes through raw pointers: a tensor-parallel shard or another dtype is refused.
    with pytest.raises(ValueError, match="cannot write experts"):
        cpu.write_gpu_layout(ids, {"w13_weight": w13[:, :inter], "w2_weight": w2[..., : inter // 2]})
    with pytest.raises(ValueError, match="bfloat16"):
        cpu.write_gpu_layout(ids, {"w13_weight": w13.half(), "w2_weight": w2.half()})


def test_auto_gpu_prefill_threshold_or_refusal() -> None:
    """auto: the layer's break-even where nothing refuses, else 0."""
    from vllm_kt_plugin.hybrid.staging_policy import auto_min_tokens

    assert auto_min_tokens(None, None, 1024) == 1024
    assert auto_min_tokens(None, "the layer cannot be staged", 1024) == 0
    assert auto_min_tokens("the staging would not fit", None, 2048) == 0


def test_a_writer_whose_layout_differs_is_caught_before_use() -> None:
    """kt-kernel writes through raw pointers: the shadow's tensors (e.g. with biases, or
    other block scales) must be exactly what the CPU backend writes."""
    from types import SimpleNamespace

    from vllm_kt_plugin.hybrid.host_experts import HostExperts

    written = {"w13_weight": ((2, 8, 4), torch.bfloat16), "w2_weight": ((2, 4, 4), torch.bfloat16)}
    writer = SimpleNamespace(gpu_layout=lambda n: {k: ((n, *s[1:]), d) for k, (s, d) in written.items()})

    def host(layout: dict) -> SimpleNamespace:
        layout = {k: (torch.Size(s), d) for k, (s, d) in layout.items()}
        return SimpleNamespace(writer=writer, layout=layout, cpu_expert_ids=[3, 5], native=object())

    assert HostExperts.writer_mismatch(host(written)) is None
    biased = {**written, "w13_bias": ((2, 8), torch.bfloat16)}
    assert "w13_bias" in (HostExperts.writer_mismatch(host(biased)) or "")
    assert HostExperts.writer_mismatch(SimpleNamespace(writer=None)) is None


@pytest.mark.parametrize("backend", ["torch", "kt_kernel"])
def test_split_matches_dense_reference_and_splits(
    vllm_layer_context, fresh_process_state, tmp_path: Path, backend: str
) -> None:
    """KT_GPU_PREFILL_SPLIT=0.5 (the split forced, as on the CPU build): in two consecutive
    layers, forwards at the threshold stage half of their picked CPU experts (most-picked
    first) through the staging buffers and leave the rest to the CPU backend (kt-kernel
    skips the staged ones' ids, set to -1); each layer prefetches the next one's predicted
    part. The output matches the dense reference, and every such forward really split."""
    idx = fresh_layer_index()
    layers = {idx: random_experts(E, seed=41), idx + 1: random_experts(E, seed=42)}
    assert fresh_layer_index() == idx + 1
    env = {"kt_num_gpu_experts": "2", "kt_gpu_prefill_min_tokens": "12", "kt_gpu_prefill_split": "0.5"}
    if backend == "kt_kernel":
        write_kt_checkpoint(tmp_path, layers)
        env.update(kt_weight_path=str(tmp_path), kt_cpuinfer="1", kt_method="BF16")
    else:
        env.update(kt_backend="torch")
    runners = {i: build_moe(kt_config(**env), layer_idx=i) for i in layers}
    for i, runner in runners.items():
        load(runner, layers[i])
    from vllm_kt_plugin.hybrid.split_path import SplitPath

    methods = {i: r.routed_experts.quant_method for i, r in runners.items()}
    splits = {i: m.gpu_prefill for i, m in methods.items()}
    assert all(isinstance(p, SplitPath) and p.by_expert for p in splits.values())
    assert [p.name for p in methods[idx].paths] == [SPLIT_PATH, CPU_PATH]
    for step, tokens in enumerate((11, 12, 40, 40)):
        for i, runner in runners.items():
            layer = runner.routed_experts
            x = torch.randn(tokens, HIDDEN, generator=torch.Generator().manual_seed(10 * step + i)).to(torch.bfloat16)
            ids, weights = random_routing(tokens, E, K, seed=100 * step + i)
            split = splits[i]
            before = (split.forwards, split.splits, split.staged_experts, split.picked_experts)
            out = layer.quant_method.apply(layer, x, weights, ids, None, None)
            assert_close(out, reference_moe(x, ids, weights, layers[i]))
            staged = split.staged_experts - before[2]
            picked = split.picked_experts - before[3]
            if tokens < 12:  # below the threshold: the CPU path, nothing counted
                assert (split.forwards, staged) == (before[0], 0)
            else:
                assert split.splits == before[1] + 1 and 0 < staged < picked, (tokens, staged, picked)


class _StageClock:
    """A clock for the probe that advances only by the costs of a known model: each CPU
    submit, each staged-expert forward and the routing read-back charge fixed + per expert
    routed + per pick, each expert row copied into a staging buffer (its public counter)
    charges COPY. The real layer still computes; its own time is not counted."""

    COPY = 7e-5  # seconds per expert row copied in
    CPU = (2e-4, 3e-5, 5e-7)  # fixed, per expert, per pick
    GPU = (4e-4, 1e-5, 1e-7)
    OVERHEAD = 6e-5

    def __init__(self, staging: object) -> None:
        self.staging = staging
        self.now = 1000.0
        self.seen = staging.rows_copied  # type: ignore[attr-defined]

    def charge(self, costs: tuple[float, float, float], ids: torch.Tensor) -> None:
        fixed, per_expert, per_pick = costs
        self.now += fixed + per_expert * int(ids.unique().numel()) + per_pick * ids.numel()

    def perf_counter(self) -> float:
        copied = self.staging.rows_copied  # type: ignore[attr-defined]
        self.now += self.COPY * max(copied - self.seen, 0)
        self.seen = copied
        return self.now


def test_split_probe_measures_what_it_times(vllm_layer_context, fresh_process_state, monkeypatch) -> None:
    """The start-up probe on a real layer (here the CPU build's: CPU backend = torch, "GPU" =
    vLLM's CPU kernel). Timed for real it yields finite, non-negative costs the model can
    plan with, and leaves the staging counters as they were (it is no forward). Timed by a
    ``_StageClock`` — the same layer's stages costing what a known model says — it returns
    that model: the copy per expert row really copied, the CPU backend's and the staged
    experts' fixed, per-expert and per-pick costs apart, the routing read-back. A probe that
    copies nothing, mixes the sides up or miscounts experts or picks gets other numbers."""
    import time

    from vllm_kt_plugin.hybrid.split_cost import plan
    from vllm_kt_plugin.hybrid.split_path import SplitPath
    from vllm_kt_plugin.hybrid.split_probe import probe

    runner = build_moe(kt_config(kt_backend="torch", kt_num_gpu_experts="2", kt_gpu_prefill_min_tokens="4"))
    load(runner, random_experts(E, seed=43))
    method = runner.routed_experts.quant_method
    prefill = method.gpu_prefill  # the whole-layer stream (a number, no share): its copy and buffers
    assert prefill is not None and not isinstance(prefill, SplitPath)
    host, staging = prefill.host, prefill.staging

    path = SplitPath(method.parts, 4, method.cpu)  # the cost model (no share)
    path.attach(host, staging)
    assert path.share is None
    counters = staging.rows_copied, staging.uses
    probed = probe(path, torch.bfloat16)
    costs = probed.for_host(host)
    assert costs.copy_s_per_expert > 0 and costs.cpu_s_per_pick >= 0 and costs.overhead_s > 0
    assert probed.expert_nbytes == host.expert_nbytes == host.staged_nbytes // (E - 2)
    assert plan(costs, [3] * (E - 2)).picked == E - 2
    assert (staging.rows_copied, staging.uses) == counters  # the probe is not a forward

    clock = _StageClock(staging)
    cpu, apply, counts = method.cpu.submit, host.apply, path.counts

    def submit(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> None:
        clock.charge(clock.CPU, ids)
        cpu(x, ids, weights)

    def staged(views: dict, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, *rest: object) -> torch.Tensor:
        clock.charge(clock.GPU, ids)
        return apply(views, x, weights, ids, *rest)

    def read_back(ids: torch.Tensor) -> list[int]:
        clock.now += clock.OVERHEAD
        return counts(ids)

    monkeypatch.setattr(method.cpu, "submit", submit)
    monkeypatch.setattr(host, "apply", staged)
    monkeypatch.setattr(path, "counts", read_back)
    monkeypatch.setattr(time, "perf_counter", clock.perf_counter)
    costs = probe(path, torch.bfloat16).for_host(host)

    measured = (costs.cpu_s_fixed, costs.cpu_s_per_expert, costs.cpu_s_per_pick)
    assert measured == pytest.approx(clock.CPU, rel=1e-6)
    measured = (costs.gpu_s_fixed, costs.gpu_s_per_expert, costs.gpu_s_per_pick)
    assert measured == pytest.approx(clock.GPU, rel=1e-6)
    assert costs.copy_s_per_expert == pytest.approx(clock.COPY, rel=1e-6)
    assert costs.overhead_s == pytest.approx(clock.OVERHEAD, rel=1e-6)
    assert costs.write_s_per_expert == 0  # the torch backend keeps a host copy: nothing written


def test_split_takes_the_whole_layer_from_its_threshold(vllm_layer_context, fresh_process_state) -> None:
    """Above ``whole_min_tokens`` (the cost model's choice, path_thresholds) the split stages
    every CPU expert with no routing read-back and leaves nothing to the CPU; below it, it
    plans as before, and below ``plan_min_tokens`` it leaves every expert to the CPU. Matches
    the dense reference each way, and names the way it ran to the timeline."""
    from vllm_kt_plugin.hybrid.split_cost import WHOLE, SplitCosts
    from vllm_kt_plugin.hybrid.split_path import SplitPath
    from vllm_kt_plugin.hybrid.timeline import Timeline

    runner = build_moe(kt_config(kt_backend="torch", kt_num_gpu_experts="2", kt_gpu_prefill_min_tokens="4"))
    experts = random_experts(E, seed=47)
    load(runner, experts)
    method = runner.routed_experts.quant_method
    prefill = method.gpu_prefill
    path = SplitPath(method.parts, 4, method.cpu)  # the cost model (no share), on the loaded layer's copy
    path.attach(prefill.host, prefill.staging)
    path.costs = SplitCosts(1e-5, 1e-5, 1e-6, 1e-6, 1e-8)  # probed in the engine; here, a copy that splits 16 tokens
    path.plan_min_tokens, path.whole_min_tokens = 8, 32
    layer = runner.routed_experts
    submitted = []
    real_submit = method.cpu.submit
    method.cpu.submit = lambda *a: (submitted.append(a[0].shape[0]), real_submit(*a))[1]  # type: ignore[method-assign]
    timeline = Timeline()
    timeline.add_layer(0)
    timeline.enable("test", 1)
    for tokens, way in ((6, CPU_PATH), (16, SPLIT_PATH), (40, WHOLE)):
        whole = way == WHOLE
        x = torch.randn(tokens, HIDDEN, generator=torch.Generator().manual_seed(tokens)).to(torch.bfloat16)
        ids, weights = random_routing(tokens, E, K, seed=tokens)
        copied, forwards, wholes = prefill.staging.rows_copied, path.forwards, path.whole_forwards
        resident = len(prefill.staging.resident(prefill.host))  # what the split left staged
        marks = timeline.layer_marks(0, tokens, SPLIT_PATH, x.device)
        out = path.run(Forward(layer, x, weights, ids, False), marks)
        assert_close(out, reference_moe(x, ids, weights, experts))
        assert path.whole_forwards == wholes + whole and path.forwards == forwards + (way == SPLIT_PATH)
        if whole:  # every CPU expert not resident copied, and nothing submitted to the CPU
            assert prefill.staging.rows_copied - copied == E - 2 - resident and submitted[-1] != tokens
        elif way == CPU_PATH:
            assert prefill.staging.rows_copied == copied and submitted[-1] == tokens
        else:  # some of the picked CPU experts staged, the rest submitted
            assert 0 < path.staged_experts < path.picked_experts and submitted[-1] == tokens
    assert submitted[-1] == 16
    assert [(s["tokens"], s["layers"][0]["path"]) for s in timeline.collect()] == [
        (6, CPU_PATH),
        (16, SPLIT_PATH),
        (40, WHOLE),
    ]


def test_block_fp8_quantization_round_trips() -> None:
    """The FP8 copy's quantizer: 128 x 128 blocks, each scaled to its own largest value
    (partial blocks at the edges too); e4m3 keeps 3 mantissa bits, so each weight comes
    back within 2**-4 of its magnitude (half an ulp), plus the block's subnormal floor."""
    from vllm_kt_plugin.hybrid.host_experts import quantize_block_fp8

    weight = torch.randn(200, 300, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    weight[:128, :128] *= 100  # one block far larger: its scale must not spill into others
    q, scale = quantize_block_fp8(weight)
    assert q.dtype == torch.float8_e4m3fn and q.shape == (200, 300) and scale.shape == (2, 3)
    back = q.float() * scale.repeat_interleave(128, 0).repeat_interleave(128, 1)[:200, :300]
    floor = 2**-9 * scale.repeat_interleave(128, 0).repeat_interleave(128, 1)[:200, :300]
    assert bool(((back - weight.float()).abs() <= weight.float().abs() * 2**-4 + floor).all())


@pytest.mark.skipif(
    not cpu_runs_block_fp8_moe(),
    reason="vLLM's CPU build runs block-FP8 MoE only on AMX CPUs (CPUExpertsFp8); the GPU sitting measures it",
)
@pytest.mark.parametrize("split", ["auto", "0.5"])
def test_fp8_host_copy_matches_dense_reference(vllm_layer_context, fresh_process_state, split: str) -> None:
    """KT_GPU_PREFILL_FP8_COPY=1: the CPU experts' host copy is block FP8, quantized as the
    checkpoint loads and run by vLLM's FP8 MoE method (here its CPU build's kernel) from the
    staging buffer, whole layer or split; half the bytes of the BF16 copy. Within FP8's
    error of the dense reference (measured: see the bound). Experts 128 wide: the CPU kernel
    takes 128 x 128 blocks only (vLLM refines the blocks of narrower experts)."""
    env = dict(kt_backend="torch", kt_num_gpu_experts="2", kt_gpu_prefill_min_tokens="12", kt_gpu_prefill_fp8_copy="1")
    runner = build_moe(kt_config(**env, kt_gpu_prefill_split=split), inter=FP8_BLOCK)
    layer = runner.routed_experts
    method = layer.quant_method
    experts = random_experts(E, seed=44, inter=FP8_BLOCK)
    load(runner, experts)
    prefill = method.gpu_prefill
    assert prefill.host.fp8_copy and prefill.host.binds_scales
    bf16_bytes = (E - 2) * 3 * HIDDEN * FP8_BLOCK * 2
    assert prefill.host.host_nbytes < 0.6 * bf16_bytes, (prefill.host.host_nbytes, bf16_bytes)
    uses = prefill.staging.uses
    x = torch.randn(40, HIDDEN, generator=torch.Generator().manual_seed(45)).to(torch.bfloat16)
    ids, weights = random_routing(40, E, K, seed=46)
    out = method.apply(layer, x, weights, ids, None, None)
    assert prefill.staging.uses == uses + 1
    ref = reference_moe(x, ids, weights, experts)
    err = (out.float() - ref).abs().max().item() / ref.abs().max().item()
    print(f"FP8 copy ({split}): max error {err:.4f} of the output's largest value")
    assert err <= FP8_COPY_LAYER_BOUND, err


def test_fp8_host_copy_refuses_experts_the_cpu_kernel_cannot_block(vllm_layer_context) -> None:
    """On vLLM's CPU build, experts narrower than one 128 x 128 block (the tiny layer's 64)
    are one clear line at build time, not vLLM's "Unsupported FP8 MoE backend: NONE" while
    the weights load (the AMX check comes first where there is no AMX)."""
    env = dict(kt_backend="torch", kt_num_gpu_experts="2", kt_gpu_prefill_min_tokens="12", kt_gpu_prefill_fp8_copy="1")
    why = "128 x 128 blocks only" if cpu_runs_block_fp8_moe() else "only on AMX CPUs"
    with pytest.raises(KTConfigError, match=why) as refused:
        build_moe(kt_config(**env))
    assert refused.value.variable == "KT_GPU_PREFILL_FP8_COPY"


def test_fp8_host_copy_loads_each_shard_into_its_blocks(vllm_layer_context) -> None:
    """The FP8 copy's loader (runs on any CPU, unlike vLLM's FP8 kernel): each checkpoint
    tensor is quantized into its expert's rows of the block-FP8 shadow — gate then up in
    w13, each half with its own block scales, down in w2 — and dequantizes to the tensor."""
    from vllm_kt_plugin.hybrid.host_experts import HostExperts

    runner = build_moe(kt_config(kt_backend="torch", kt_num_gpu_experts="2"))
    layer = runner.routed_experts
    method = layer.quant_method
    cpu_ids = method.placement.cpu_expert_ids()
    args = dict(hidden_size=HIDDEN, intermediate_size_per_partition=INTER, params_dtype=torch.bfloat16)
    host = HostExperts(layer, method.parts.make_shadow_native, cpu_ids, args, pin=False, fp8_copy=True)
    assert host.binds_scales and set(host.layout) >= {"w13_weight", "w13_weight_scale_inv", "w2_weight"}
    experts = random_experts(E, seed=47)
    shards = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}
    for slot, expert in enumerate(cpu_ids):
        for name, shard in shards.items():
            param = "w2_weight" if shard == "w2" else "w13_weight"
            host.load(param, experts[expert][name], f"{expert}.{name}.weight", shard, slot)
    shadow = host.shadow

    def dequantized(name: str, slot: int) -> torch.Tensor:
        q, scale = getattr(shadow, name).data[slot].float(), getattr(shadow, f"{name}_scale_inv").data[slot]
        halves = 2 if name == "w13_weight" else 1  # gate and up: blocks of their own (INTER < 128 here)
        parts = []
        for q_part, s_part in zip(q.chunk(halves), scale.chunk(halves), strict=True):
            full = s_part.repeat_interleave(128, 0).repeat_interleave(128, 1)[: q_part.shape[0], : q_part.shape[1]]
            parts.append(q_part * full)
        return torch.cat(parts)

    for slot, expert in enumerate(cpu_ids):
        w13 = torch.cat([experts[expert]["gate_proj"], experts[expert]["up_proj"]]).float()
        for name, want in (("w13_weight", w13), ("w2_weight", experts[expert]["down_proj"].float())):
            got = dequantized(name, slot)
            assert bool(((got - want).abs() <= want.abs() * 2**-4 + 2**-9 * want.abs().max()).all()), (name, slot)
