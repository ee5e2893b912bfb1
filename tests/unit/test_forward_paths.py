"""The hybrid forward's structure on real vLLM MoE layers (torch CPU backend): a forward
takes the first path in ``paths.PATH_BUILDERS`` that accepts it, and the observers the
layer subscribed hear it (routing recorder, metrics), with nothing inline for either."""

from __future__ import annotations

import pytest
import torch

from vllm_kt_plugin.hybrid import paths
from vllm_kt_plugin.hybrid.contracts import Forward, ForwardPath, LayerParts, StageMarks
from vllm_kt_plugin.hybrid.metrics import CPU_PATH, GPU_PREFILL_PATH, SPLIT_PATH
from vllm_kt_plugin.hybrid.quant_config import KTHybridConfig
from vllm_kt_plugin.settings.loader import load_settings
from vllm_kt_tools.support.moe_layers import HIDDEN, build_moe, load, random_experts, random_routing, reference_moe

E, K = 8, 2
# The hybrid layer's output against the dense float32 reference, relative to the reference's
# largest value. Cause: bf16 rounding of the native kernel's output and of the CPU+GPU sum,
# about 2 ulp = 2**-7, as test_moe_method's ATOL_REL. Measured on the 2-core AMX dev box
# (torch backend, 3 of 8 experts on vLLM's CPU kernel; `pytest -s tests/unit/test_forward_paths.py
# -k "plugs_in or compiled_op"`, 2026-12-06): 0.0029 (5 tokens), 0.0036 (6), 0.0029 (the op, 8);
# over 150 such forwards (5, 6 and 8 tokens, seeds 0-49, a one-off loop over `forward` below) at
# most 0.0055, median 0.0035. Bound: 2**-6 = 0.0156, twice that rounding and 2.8x the largest
# measured (a path that doubles the output is compared, relatively, with a doubled reference).
REFERENCE_BOUND = 2**-6


def hybrid_layer(**env: str):
    config = KTHybridConfig(settings=load_settings({"KT_BACKEND": "torch", **env}, cores=4))
    runner = build_moe(config)
    experts = random_experts(E, seed=3)
    load(runner, experts)
    return runner.routed_experts, experts


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return (out.float() - ref).abs().max().item() / ref.abs().max().item()


def forward(layer, tokens: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    x = torch.randn(tokens, HIDDEN, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)
    ids, weights = random_routing(tokens, E, K, seed=seed)
    return layer.quant_method.apply(layer, x, weights, ids, None, None), x, ids, weights


def test_paths_are_asked_in_order(vllm_layer_context, fresh_process_state) -> None:
    """GPU prefill (or, where the split applies, the split instead) before the CPU-experts
    path, which takes every forward left."""
    layer, _ = hybrid_layer(KT_NUM_GPU_EXPERTS="3", KT_GPU_PREFILL_MIN_TOKENS="12")
    method = layer.quant_method
    assert [p.name for p in method.paths] == [GPU_PREFILL_PATH, CPU_PATH]
    split, _ = hybrid_layer(KT_NUM_GPU_EXPERTS="3", KT_GPU_PREFILL_MIN_TOKENS="12", KT_GPU_PREFILL_SPLIT="0.5")
    assert [p.name for p in split.quant_method.paths] == [SPLIT_PATH, CPU_PATH]
    assert [p.name for p in hybrid_layer(KT_NUM_GPU_EXPERTS="3")[0].quant_method.paths] == [CPU_PATH]
    assert [m.layer_idx for m in fresh_process_state.layers] == sorted(m.layer_idx for m in fresh_process_state.layers)


def test_a_new_path_plugs_in_by_its_place_in_the_builders(
    vllm_layer_context, fresh_process_state, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A builder put before the CPU path takes the forwards it accepts; the others still
    reach the CPU path."""
    taken: list[int] = []

    class Doubles(ForwardPath):
        name = "test-doubles"

        def __init__(self, parts: LayerParts) -> None:
            self.cpu_path = paths.cpu_path.build(parts)

        def takes(self, fwd: Forward) -> bool:
            return fwd.tokens == 5

        def run(self, fwd: Forward, marks: StageMarks) -> torch.Tensor:
            taken.append(fwd.tokens)
            return 2 * self.cpu_path.run(fwd, marks)

    *others, last = paths.PATH_BUILDERS
    monkeypatch.setattr(paths, "PATH_BUILDERS", (*others, Doubles, last))
    layer, experts = hybrid_layer(KT_NUM_GPU_EXPERTS="3")
    for tokens, factor in ((5, 2), (6, 1)):
        out, x, ids, weights = forward(layer, tokens, seed=tokens)
        error = relative_error(out, factor * reference_moe(x, ids, weights, experts))  # of a doubled reference
        print(f"{tokens} tokens (path output x{factor}): relative error {error:.4f}")
        assert error <= REFERENCE_BOUND, (tokens, error)
    assert taken == [5]


def test_the_recorder_hears_forwards_only_while_enabled(vllm_layer_context, fresh_process_state) -> None:
    layer, _ = hybrid_layer(KT_NUM_GPU_EXPERTS="3")
    recorder = fresh_process_state.recorder
    forward(layer, 4)
    assert recorder.counts == {}
    recorder.enabled = True
    _, _, ids, _ = forward(layer, 6, seed=1)
    idx = layer.quant_method.layer_idx
    assert recorder.counts[idx].tolist() == torch.bincount(ids.flatten().long(), minlength=E).tolist()
    assert recorder.cpu_evaluations[idx] == int((ids >= 3).sum())  # experts 3..7 are on the CPU


def test_metrics_time_the_cpu_path_of_layers_with_cpu_experts(vllm_layer_context, fresh_process_state) -> None:
    """KT_METRICS_INTERVAL: one process collector, fed by the layer's CPU-path forwards."""
    layer, _ = hybrid_layer(KT_NUM_GPU_EXPERTS="3", KT_METRICS_INTERVAL="3600")
    metrics = fresh_process_state.metrics(3600.0)
    assert metrics is not None and metrics.layers == [layer.quant_method.layer_idx]
    for _ in range(2):
        forward(layer, 4)
    totals = metrics.totals()
    assert [(k, t.forwards) for k, t in totals.items()] == [((layer.quant_method.layer_idx, 4), 2)]
    all_gpu, _ = hybrid_layer(KT_NUM_GPU_EXPERTS=str(E), KT_METRICS_INTERVAL="3600")
    assert all_gpu.quant_method.layer_idx not in metrics.layers  # no CPU experts: nothing to time


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
