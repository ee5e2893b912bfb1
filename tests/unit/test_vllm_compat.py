"""Every vLLM internal kt-hybrid relies on (``hybrid/vllm_compat.py``'s TOUCHES) exists
on the installed vLLM: an upgrade that renames one fails here, by name, and not in the
middle of a forward."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest
import torch

from vllm_kt_plugin.hybrid.vllm_compat import TOUCHES, Touch
from vllm_kt_tools.support.moe_layers import build_moe

BLOCK_FP8 = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}


def owner_of(touch: Touch) -> object:
    module, _, cls = touch.owner.partition(":")
    found = importlib.import_module(module)
    return getattr(found, cls) if cls else found


@pytest.fixture(scope="module")
def instances(vllm_layer_context) -> dict[str, object]:
    """One instance of each class whose instance attributes we touch, built as a model
    builds them (plain vLLM, no kt-hybrid: the attributes are vLLM's)."""
    from vllm.model_executor.layers.quantization.fp8 import Fp8Config

    plain = build_moe(None)
    fp8 = build_moe(Fp8Config.from_config(dict(BLOCK_FP8)), hidden=256, inter=256).routed_experts
    return {
        "MoERunner": plain,
        "RoutedExperts": plain.routed_experts,
        "ExpertMapManager": plain.routed_experts.expert_map_manager,
        "FusedMoEConfig": plain.routed_experts.moe_config,
        "UnquantizedFusedMoEMethod": plain.routed_experts.quant_method,
        "FusedMoEMethodBase": plain.routed_experts.quant_method,
        "Fp8MoEMethod": fp8.quant_method,
    }


@pytest.mark.parametrize("touch", TOUCHES, ids=lambda t: f"{t.owner}.{t.attribute}")
def test_the_vllm_internal_exists(touch: Touch, instances: dict[str, object]) -> None:
    owner = owner_of(touch)
    if touch.on == "owner":
        assert hasattr(owner, touch.attribute), f"vLLM no longer has {touch.owner}.{touch.attribute}: {touch.relied_on}"
        return
    assert touch.on == "instance", touch
    instance = instances[touch.owner.partition(":")[2]]
    assert isinstance(instance, owner), (type(instance), owner)  # type: ignore[arg-type]
    found = hasattr(instance, touch.attribute) or touch.attribute in getattr(instance, "_buffers", {})
    assert found, f"vLLM's {touch.owner} instances no longer have {touch.attribute}: {touch.relied_on}"


def test_every_touched_class_has_an_instance_here(instances: dict[str, object]) -> None:
    """A new instance touch needs an instance above, or the test above cannot check it."""
    wanted = {t.owner.partition(":")[2] for t in TOUCHES if t.on == "instance"}
    assert wanted <= set(instances)


def test_the_op_finds_its_layer_through_the_forward_context(vllm_layer_context) -> None:
    """As vLLM's moe_forward does: the runner registered under the layer's name."""
    from vllm.forward_context import set_forward_context

    from vllm_kt_plugin.hybrid.vllm_compat import routed_experts_of

    runner = build_moe(None)
    with set_forward_context(None, vllm_layer_context):
        assert routed_experts_of(runner.routed_experts.layer_name) is runner.routed_experts


# A fresh process: this one asked already (vllm_world). ARCH_GET_XCOMP_PERM = 0x1022 (syscall
# arch_prctl, 158) reads the granted features; bit 18 is XFEATURE_XTILEDATA, AMX's tile data.
_TILE_PERMISSION = """
import ctypes
libc = ctypes.CDLL(None, use_errno=True)
def granted():
    mask = ctypes.c_ulong(0)
    assert libc.syscall(158, 0x1022, ctypes.byref(mask)) == 0, ctypes.get_errno()
    return bool(mask.value & (1 << 18))
before = granted()
from vllm_kt_plugin.hybrid.vllm_compat import ask_for_amx_tiles
print(before, ask_for_amx_tiles(), granted())
"""


@pytest.mark.skipif(
    not torch.cpu._is_amx_tile_supported(), reason="this CPU has no AMX tiles: there is no permission to ask for"
)
def test_ask_for_amx_tiles_gets_the_tile_permission() -> None:
    """What keeps vLLM's CPU kernels from dying of SIGILL under --enforce-eager (see
    ask_for_amx_tiles): a process starts without tile permission and has it afterwards."""
    out = subprocess.run([sys.executable, "-c", _TILE_PERMISSION], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "True", "True"], out
