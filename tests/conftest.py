"""Shared fixtures: tiny generated checkpoints and a vLLM context for building layers."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


def _cache_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Tiny models are trained once per machine (~30-45 s each) and reused: the
    directory name carries the generator's version so a change retrains them."""
    root = os.environ.get("VLLM_KT_TEST_MODEL_CACHE")
    return Path(root) if root else tmp_path_factory.getbasetemp() / "tiny-models"


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory):
    """``tiny_model(arch)`` -> directory of a trained tiny checkpoint of that arch
    (``quantizable=True``: its variant with every linear width a multiple of 128;
    ``gguf_experts=True``: with 256-wide experts, which kt-kernel's LLAMAFILE needs)."""
    from vllm_kt_tools.support.tiny_models import tiny_model_dir

    root = _cache_root(tmp_path_factory)

    def get(arch: str, *, quantizable: bool = False, gguf_experts: bool = False) -> Path:
        return tiny_model_dir(arch, root, quantizable=quantizable, gguf_experts=gguf_experts)

    return get


@pytest.fixture(scope="session")
def quantized_model(tmp_path_factory: pytest.TempPathFactory):
    """``quantized_model(arch, fmt)`` -> directory of a tiny checkpoint in a quantized
    format (``vllm_kt_tools.support.quantized_checkpoints.FORMATS``)."""
    from vllm_kt_tools.support.quantized_checkpoints import quantized_model_dir

    root = _cache_root(tmp_path_factory)

    def get(arch: str, fmt: str) -> Path:
        return quantized_model_dir(arch, fmt, root)

    return get


@pytest.fixture(scope="session")
def vllm_layer_context(tmp_path_factory: pytest.TempPathFactory) -> Iterator[object]:
    """A single-process vLLM world (gloo) and a VllmConfig, enough to build MoE layers
    the way a model does. Yields the VllmConfig's model dir-less factory context."""
    from kt_testing.config_only import write_config_only_qwen3_moe
    from vllm.config import ModelConfig, VllmConfig

    from vllm_kt_tools.support.moe_layers import vllm_world

    model_dir = write_config_only_qwen3_moe(tmp_path_factory.mktemp("config-only"), layers=4)
    vllm_config = VllmConfig(model_config=ModelConfig(model=str(model_dir), dtype="bfloat16", skip_tokenizer_init=True))
    with vllm_world(vllm_config):
        yield vllm_config


@pytest.fixture
def run_notebook(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """``run_notebook(name)`` -> examples/<name>, executed (``kt_testing.notebooks``)."""
    from kt_testing.notebooks import notebook_runner

    return notebook_runner(tmp_path, monkeypatch)


@pytest.fixture
def fresh_process_state(monkeypatch: pytest.MonkeyPatch) -> object:
    """A process state (``hybrid.process_state``) of the layers this test builds only: the
    layers other tests built stay out of its next-layer lookups and probes."""
    from vllm_kt_plugin.hybrid import process_state

    fresh = process_state.HybridProcessState()
    monkeypatch.setattr(process_state, "_PROCESS_STATE", fresh)
    return fresh
