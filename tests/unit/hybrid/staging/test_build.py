"""A layer's staging path, built from its plan (``hybrid/staging/build.py``): on real vLLM
MoE layers (vLLM's CPU build), what the layer's facts make of the settings."""

from __future__ import annotations

import pytest
from kt_testing.hybrid_layers import kt_config

from vllm_kt_plugin.hybrid.staging.build import staging_path
from vllm_kt_plugin.hybrid.staging.plan import OFF, SPLIT_PATH, WHOLE_LAYER_PATH
from vllm_kt_plugin.hybrid.staging.split import SplitPath
from vllm_kt_plugin.hybrid.staging.whole_layer import WholeLayerPath
from vllm_kt_plugin.hybrid.vllm_compat import cpu_runs_block_fp8_moe
from vllm_kt_plugin.settings.errors import KTConfigError
from vllm_kt_tools.support.moe_layers import build_moe


def test_staging_is_off_by_default(vllm_layer_context) -> None:
    runner = build_moe(kt_config(kt_backend="torch", kt_num_gpu_experts="2"))
    assert staging_path(runner.routed_experts.quant_method.paths) is None


def test_the_plan_builds_one_of_the_two_siblings(vllm_layer_context, fresh_process_state) -> None:
    """A number builds the whole-layer path, a share the split; each holds its own
    LayerStaging with the plan it was built from, and neither is the other's kind."""
    whole = staging_path(
        build_moe(
            kt_config(kt_backend="torch", kt_num_gpu_experts="2", kt_staging_min_tokens="12")
        ).routed_experts.quant_method.paths
    )
    env = dict(kt_backend="torch", kt_num_gpu_experts="2", kt_staging_min_tokens="12", kt_staging_split="0.5")
    split = staging_path(build_moe(kt_config(**env)).routed_experts.quant_method.paths)
    assert isinstance(whole, WholeLayerPath) and not isinstance(whole, SplitPath)
    assert isinstance(split, SplitPath) and not isinstance(split, WholeLayerPath)
    assert (whole.staging.plan.path, whole.min_tokens) == (WHOLE_LAYER_PATH, 12)
    assert (split.staging.plan.path, split.min_tokens, split.share) == (SPLIT_PATH, 12, 0.5)
    assert whole.staging is not split.staging and OFF not in (whole.staging.plan.path, split.staging.plan.path)


def test_fp8_host_copy_refuses_experts_the_cpu_kernel_cannot_block(vllm_layer_context) -> None:
    """On vLLM's CPU build, experts narrower than one 128 x 128 block (the tiny layer's 64)
    are one clear line at build time, not vLLM's "Unsupported FP8 MoE backend: NONE" while
    the weights load (the AMX check comes first where there is no AMX)."""
    env = dict(kt_backend="torch", kt_num_gpu_experts="2", kt_staging_min_tokens="12", kt_staging_fp8_copy="1")
    why = "128 x 128 blocks only" if cpu_runs_block_fp8_moe() else "only on AMX CPUs"
    with pytest.raises(KTConfigError, match=why) as refused:
        build_moe(kt_config(**env))
    assert refused.value.variable == "KT_STAGING_FP8_COPY"
