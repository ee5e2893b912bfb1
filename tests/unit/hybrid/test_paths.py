"""The layer's forward paths (``hybrid/paths.py``) on real vLLM MoE layers (torch CPU backend):
a forward takes the first path in ``paths.PATH_BUILDERS`` that accepts it."""

from __future__ import annotations

import pytest
import torch
from kt_testing.hybrid_layers import REFERENCE_BOUND, forward, hybrid_layer, relative_error

from vllm_kt_plugin.hybrid import paths
from vllm_kt_plugin.hybrid.contracts import Forward, ForwardPath, LayerParts, StageMarks
from vllm_kt_plugin.hybrid.staging.plan import CPU_PATH, SPLIT_PATH, WHOLE_LAYER_PATH
from vllm_kt_tools.support.moe_layers import reference_moe


def test_paths_are_asked_in_order(vllm_layer_context, fresh_process_state) -> None:
    """The staging path the plan chose (the whole layer, or the split instead) before the
    CPU-experts path, which takes every forward left."""
    layer, _ = hybrid_layer(KT_NUM_GPU_EXPERTS="3", KT_STAGING_MIN_TOKENS="12")
    method = layer.quant_method
    assert [p.name for p in method.paths] == [WHOLE_LAYER_PATH, CPU_PATH]
    split, _ = hybrid_layer(KT_NUM_GPU_EXPERTS="3", KT_STAGING_MIN_TOKENS="12", KT_STAGING_SPLIT="0.5")
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
