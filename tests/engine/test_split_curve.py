"""``vllm-kt bench --layer-only --split-curve`` runs end to end before the GPU sitting needs
it: the same child function on vLLM's CPU build (a config-only tiny Qwen3-MoE, dummy
AMXINT8 CPU experts, two layers), every path at two sizes, the split's counters in the
rows. Times on this build mean nothing (the "GPU" is the CPU); only the shape is checked."""

from __future__ import annotations

from pathlib import Path

import pytest
from kt_testing.config_only import write_config_only_qwen3_moe
from kt_testing.hardware import requires_kernel

from vllm_kt_tools.bench.layer_timing import timing_in_child

pytestmark = pytest.mark.engine


@requires_kernel("AMXINT8")
def test_split_curve_runs_on_the_cpu_build(tmp_path: Path) -> None:
    model = write_config_only_qwen3_moe(tmp_path / "config-only", layers=2)
    env = {
        "KT_METHOD": "AMXINT8",
        "KT_NUM_GPU_EXPERTS": "2",
        "KT_STAGING_MIN_TOKENS": "1",
        "KT_CHUNKED_PREFILL_SIZE": "2048",
        "KT_CACHE_DIR": str(tmp_path / "cache"),
        "KT_CPUINFER": "1",
        "VLLM_CPU_KVCACHE_SPACE": "1",
    }
    args = {"model_dir": str(model), "env": env, "tokens": [16, 64], "layers": 2, "repeats": 1}
    target = "vllm_kt_tools.bench.split_curve:split_curve_benchmark"
    result = timing_in_child("split curve", target, args, env, tmp_path / "split.log", 600)
    assert "error" not in result, result
    for row in result["tokens"].values():
        assert {"cpu_ms", "whole_layer_ms", "split_ms"} <= set(row) and row["split_picked_per_layer"] >= 0
    for n, row in result["tokens"].items():  # the model planned every forward from its threshold on
        assert (row["split_picked_per_layer"] > 0) == (int(n) >= row["split_min_tokens"]), (n, row)
    assert result["cost_model"] is not None and result["cpu_experts_per_layer"] == 6
