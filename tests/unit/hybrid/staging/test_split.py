"""The split path (``hybrid/staging/split.py``) on real vLLM MoE layers (vLLM's CPU build:
the "GPU" is its CPU kernel): forced by a share, and with the cost model's thresholds."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from kt_testing.hybrid_layers import E, K, assert_close, kt_config, write_kt_checkpoint

from vllm_kt_plugin.hybrid.contracts import Forward
from vllm_kt_plugin.hybrid.staging.build import staging_path
from vllm_kt_plugin.hybrid.staging.costs import SplitCosts
from vllm_kt_plugin.hybrid.staging.plan import CPU_PATH, SPLIT_PATH, WHOLE_LAYER_PATH
from vllm_kt_plugin.hybrid.staging.split import SplitPath
from vllm_kt_plugin.hybrid.timeline import Timeline
from vllm_kt_tools.support.moe_layers import (
    HIDDEN,
    build_moe,
    fresh_layer_index,
    load,
    random_experts,
    random_routing,
    reference_moe,
)


@pytest.mark.parametrize("backend", ["torch", "kt_kernel"])
def test_split_matches_dense_reference_and_splits(
    vllm_layer_context, fresh_process_state, tmp_path: Path, backend: str
) -> None:
    """KT_STAGING_SPLIT=0.5 (the split forced, as on the CPU build): in two consecutive
    layers, forwards at the threshold stage half of their picked CPU experts (most-picked
    first) through the staging buffers and leave the rest to the CPU backend (kt-kernel
    skips the staged ones' ids, set to -1); each layer prefetches the next one's predicted
    part. The output matches the dense reference, and every such forward really split."""
    idx = fresh_layer_index()
    layers = {idx: random_experts(E, seed=41), idx + 1: random_experts(E, seed=42)}
    assert fresh_layer_index() == idx + 1
    env = {"kt_num_gpu_experts": "2", "kt_staging_min_tokens": "12", "kt_staging_split": "0.5"}
    if backend == "kt_kernel":
        write_kt_checkpoint(tmp_path, layers)
        env.update(kt_weight_path=str(tmp_path), kt_cpuinfer="1", kt_method="BF16")
    else:
        env.update(kt_backend="torch")
    runners = {i: build_moe(kt_config(**env), layer_idx=i) for i in layers}
    for i, runner in runners.items():
        load(runner, layers[i])
    methods = {i: r.routed_experts.quant_method for i, r in runners.items()}
    splits = {i: staging_path(m.paths) for i, m in methods.items()}
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


def test_split_takes_the_whole_layer_from_its_threshold(vllm_layer_context, fresh_process_state) -> None:
    """Above ``whole_min_tokens`` (the cost model's choice, path_thresholds) the split stages
    every CPU expert with no routing read-back and leaves nothing to the CPU; below it, it
    plans as before, and below ``plan_min_tokens`` it leaves every expert to the CPU. Matches
    the dense reference each way, and names the way it ran to the timeline."""
    runner = build_moe(kt_config(kt_backend="torch", kt_num_gpu_experts="2", kt_staging_min_tokens="4"))
    experts = random_experts(E, seed=47)
    load(runner, experts)
    method = runner.routed_experts.quant_method
    prefill = staging_path(method.paths)  # the whole-layer path; its sibling below shares its staging
    path = SplitPath(prefill.staging, method.cpu)  # the cost model (no share), on the loaded layer's copy
    path.costs = SplitCosts(1e-5, 1e-5, 1e-6, 1e-6, 1e-8)  # probed in the engine; here, a copy that splits 16 tokens
    path.plan_min_tokens, path.whole_min_tokens = 8, 32
    layer = runner.routed_experts
    submitted = []
    real_submit = method.cpu.submit
    method.cpu.submit = lambda *a: (submitted.append(a[0].shape[0]), real_submit(*a))[1]  # type: ignore[method-assign]
    timeline = Timeline()
    timeline.add_layer(0)
    timeline.enable("test", 1)
    for tokens, way in ((6, CPU_PATH), (16, SPLIT_PATH), (40, WHOLE_LAYER_PATH)):
        whole = way == WHOLE_LAYER_PATH
        x = torch.randn(tokens, HIDDEN, generator=torch.Generator().manual_seed(tokens)).to(torch.bfloat16)
        ids, weights = random_routing(tokens, E, K, seed=tokens)
        copied, forwards, wholes = prefill.buffers.rows_copied, path.forwards, path.whole_forwards
        resident = len(prefill.buffers.resident(prefill.host))  # what the split left staged
        marks = timeline.layer_marks(0, tokens, SPLIT_PATH, x.device)
        out = path.run(Forward(layer, x, weights, ids, False), marks)
        assert_close(out, reference_moe(x, ids, weights, experts))
        assert path.whole_forwards == wholes + whole and path.forwards == forwards + (way == SPLIT_PATH)
        if whole:  # every CPU expert not resident copied, and nothing submitted to the CPU
            assert prefill.buffers.rows_copied - copied == E - 2 - resident and submitted[-1] != tokens
        elif way == CPU_PATH:
            assert prefill.buffers.rows_copied == copied and submitted[-1] == tokens
        else:  # some of the picked CPU experts staged, the rest submitted
            assert 0 < path.staged_experts < path.picked_experts and submitted[-1] == tokens
    assert submitted[-1] == 16
    assert [(s["tokens"], s["layers"][0]["path"]) for s in timeline.collect()] == [
        (6, CPU_PATH),
        (16, SPLIT_PATH),
        (40, WHOLE_LAYER_PATH),
    ]
