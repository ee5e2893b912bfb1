"""The online-weight cache's pure parts: tensor collection, dummy weights, the check that a
cached layer is complete, keys and progress lines (kt-kernel itself: test_moe_method)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from vllm_kt_plugin.cpu_backends.base import DUMMY_HIGH
from vllm_kt_plugin.cpu_backends.kt_kernel.weight_cache import (
    MARKER,
    ExpertTensors,
    LoadProgress,
    cache_folder,
    layer_files_complete,
    layer_is_cached,
)


def test_collects_every_expert_and_refuses_wrong_shapes() -> None:
    tensors = ExpertTensors(num_experts=2, hidden_size=4, intermediate_size=3)
    gate = torch.ones(3, 4)
    tensors.put(0, "w1", gate)
    tensors.put(0, "w3", 2 * gate)
    tensors.put(0, "w2", torch.ones(4, 3))
    assert not tensors.complete and tensors.missing() == 3
    for shard, shape in (("w1", (3, 4)), ("w3", (3, 4)), ("w2", (4, 3))):
        tensors.put(1, shard, torch.zeros(shape))
    assert tensors.complete
    assert torch.equal(tensors.up[0], (2 * gate).to(torch.bfloat16))
    with pytest.raises(ValueError, match="expected \\(3, 4\\)"):
        tensors.put(1, "w1", torch.zeros(4, 3))
    with pytest.raises(ValueError, match="'w13'"):
        tensors.put(1, "w13", torch.zeros(6, 4))


def test_dummy_weights_fill_every_expert_in_vllms_range() -> None:
    tensors = ExpertTensors(num_experts=4, hidden_size=8, intermediate_size=8)
    tensors.fill_dummy(layer_idx=3)
    assert tensors.complete
    for t in (tensors.gate, tensors.up, tensors.down):
        assert t.abs().max() <= DUMMY_HIGH and t.abs().min() > 0
        assert torch.equal(t[1], -t[0])  # one random expert, repeated with alternating sign


def write_layer(folder: Path, layer: int, experts: int, *, short: bool = False) -> Path:
    numa = folder / f"_layer_{layer}" / "_numa_0"
    numa.mkdir(parents=True)
    for e in range(experts):
        for proj in ("gate", "up", "down"):
            for kind, size in (("quant", 64), ("scale", 8)):
                (numa / f"INT8_{proj}_{e}_{size}Byte_{kind}_.kt").write_bytes(b"x" * (size - (short and e == 0)))
    return numa.parent


def test_a_cached_layer_must_be_marked_and_complete(tmp_path: Path) -> None:
    layer_dir = write_layer(tmp_path, 5, experts=2)
    assert layer_files_complete(layer_dir, 2) and not layer_files_complete(layer_dir, 3)
    assert not layer_is_cached(tmp_path, 5, 2)  # no marker yet
    (layer_dir / MARKER).write_text("{}")
    assert layer_is_cached(tmp_path, 5, 2)
    next(layer_dir.glob("_numa_0/*.kt")).unlink()
    assert not layer_is_cached(tmp_path, 5, 2)
    short = write_layer(tmp_path / "short", 1, experts=2, short=True)
    assert not layer_files_complete(short, 2)  # a truncated file (disk full)


def test_cache_key_follows_the_weight_files(tmp_path: Path) -> None:
    model = tmp_path / "m"
    model.mkdir()
    (model / "a.safetensors").write_bytes(b"1")
    args = {"root": str(tmp_path / "c"), "model": str(model), "method": "AMXINT4", "pools": 1, "shape": (8, 64, 32)}
    first = cache_folder(model_dir=str(model), **args)
    assert first == cache_folder(model_dir=str(model), **args)
    assert first.parent.name.startswith("m-") and first.name == "AMXINT4-pools1"
    assert cache_folder(model_dir=None, **args) != first  # dummy weights
    assert cache_folder(model_dir=str(model), **{**args, "pools": 2}) != first
    (model / "a.safetensors").write_bytes(b"22")  # retrained / updated weights
    assert cache_folder(model_dir=str(model), **args) != first


def test_progress_lines_and_total(caplog: pytest.LogCaptureFixture) -> None:
    progress = LoadProgress()
    for _ in range(2):
        progress.expect_layer()
    with caplog.at_level(logging.INFO, logger="vllm.kt_hybrid"):
        progress.layer_quantized("model.layers.0.mlp.experts", "quantized", 0.5)
        progress.layer_ready("model.layers.0.mlp.experts", "loaded", 0.1)
        progress.layer_ready("model.layers.1.mlp.experts", "loaded", 0.1)
    text = caplog.text
    assert "(quantized 1 of 2 layers)" in text and "(1/2)" in text and "(2/2)" in text
    assert "CPU experts of all 2 layers ready in" in text and "(1 quantized online)" in text
