"""What both staging paths share (``hybrid/staging/layer.py``): which forwards stage, and when
the CPU backend writes the staged experts itself instead of a host copy (a GPU-only choice,
read here from stand-in layers)."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from vllm_kt_plugin.hybrid.gpu_experts import NativeKernel
from vllm_kt_plugin.hybrid.staging.layer import LayerStaging
from vllm_kt_plugin.hybrid.staging.plan import WHOLE_LAYER_PATH, StagingPlan
from vllm_kt_plugin.settings.catalogue import BLOCK_FP8, UNQUANTIZED

TRITON = NativeKernel("UnquantizedFusedMoEMethod (TRITON)", UNQUANTIZED, True, False, True)
FP8_TRITON = NativeKernel("Fp8MoEMethod (quantized)", BLOCK_FP8, False, True, True)
FLASHINFER = NativeKernel("UnquantizedFusedMoEMethod (FLASHINFER)", UNQUANTIZED, True, False, False)


def staging(kernel: NativeKernel = TRITON, method: str = "BF16", tp: int = 1, writes: bool = True) -> LayerStaging:
    cpu = SimpleNamespace(writes_gpu_layout=writes)
    parts = SimpleNamespace(
        cpu=cpu,
        moe=SimpleNamespace(tp_size=tp),
        context=SimpleNamespace(settings=SimpleNamespace(method=method)),
    )
    return LayerStaging(parts, StagingPlan(WHOLE_LAYER_PATH, 12), kernel)  # type: ignore[arg-type]


def test_the_cpu_backend_writes_where_its_layout_is_the_kernels_whole() -> None:
    """kt-kernel writes BF16 experts for unquantized ones on Triton and FP8 ones for block-FP8
    (then no host copy is kept): under CUDA, on one rank, in the checkpoint's format only."""
    bf16 = torch.bfloat16
    assert staging()._gpu_layout_writer(True, bf16) is not None
    assert staging(FP8_TRITON, "FP8")._gpu_layout_writer(True, bf16) is not None
    assert staging()._gpu_layout_writer(False, bf16) is None  # vLLM's CPU kernels repack theirs
    assert staging(tp=2)._gpu_layout_writer(True, bf16) is None  # a rank's shard, not whole experts
    assert staging(writes=False)._gpu_layout_writer(True, bf16) is None
    assert staging(method="AMXINT4")._gpu_layout_writer(True, bf16) is None  # cannot write AMX experts back
    assert staging(FP8_TRITON, "BF16")._gpu_layout_writer(True, bf16) is None  # BF16 is not the FP8 layout
    assert staging()._gpu_layout_writer(True, torch.float16) is None  # kt-kernel writes bfloat16
    assert staging(FLASHINFER)._gpu_layout_writer(True, bf16) is None  # a kernel that re-lays weights out


def test_a_forward_stages_from_its_size_once_loaded_and_never_while_captured() -> None:
    layer = staging()

    def forward(tokens: int, capturing: bool = False) -> SimpleNamespace:
        return SimpleNamespace(tokens=tokens, capturing=capturing)

    assert not layer.takes(forward(40), 12)  # no host experts yet: not loaded
    layer.host = object()  # type: ignore[assignment]
    assert layer.takes(forward(12), 12) and layer.takes(forward(40), 12)
    assert not layer.takes(forward(11), 12)
    assert not layer.takes(forward(40, capturing=True), 12)  # a graph replays no Python
