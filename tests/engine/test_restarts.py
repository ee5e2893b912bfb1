"""A start killed with SIGKILL while it quantizes the CPU experts online leaves nothing
half-written that counts as cached, and the next start finishes and serves the same
tokens as a start with an empty cache. Needs kt-kernel's AMXINT8 kernels (AVX-512/AMX)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from kt_testing.engines import PROMPTS, clean_env, generate
from kt_testing.hardware import requires_kernel

from vllm_kt_plugin.cpu_backends.kt_kernel.weight_cache import MARKER, layer_is_cached
from vllm_kt_tools.support.server import VLLMServer

pytestmark = [pytest.mark.engine, requires_kernel("AMXINT8")]

NUM_EXPERTS = 8


def kill_when_quantizing(model: Path, settings: dict[str, str], log: Path) -> str:
    """Start `vllm serve` and SIGKILL its process group as soon as the log reports the
    first quantized layer; return the log line it was killed at."""
    server = VLLMServer(model, ["--max-model-len", "256", "--quantization", "kt-hybrid"], clean_env(**settings), log)
    server.launch()
    deadline = time.monotonic() + 600
    try:
        while time.monotonic() < deadline:
            lines = [line for line in log.read_text(errors="replace").splitlines() if "(quantized " in line]
            if lines:
                server.kill()
                return lines[0]
            assert server.proc is not None and server.proc.poll() is None, log.read_text()[-3000:]
            time.sleep(0.02)
    finally:
        server.kill()
    raise AssertionError("no layer was quantized within 600 s:\n" + log.read_text()[-3000:])


def test_start_killed_while_quantizing_then_restarted(tiny_model, tmp_path: Path) -> None:
    model = tiny_model("qwen3_moe")
    settings = {"KT_METHOD": "AMXINT8", "KT_NUM_GPU_EXPERTS": "4", "KT_CACHE_DIR": str(tmp_path / "cache")}
    killed_at = kill_when_quantizing(model, settings, tmp_path / "killed.log")
    print(f"killed at: {killed_at}")
    layers = sorted((tmp_path / "cache").glob("*/*/_layer_*"))
    for layer_dir in layers:  # whatever the kill left: a layer that looks cached is complete
        index = int(layer_dir.name.removeprefix("_layer_"))
        if (layer_dir / MARKER).exists():
            assert layer_is_cached(layer_dir.parent, index, NUM_EXPERTS), layer_dir
    print(f"layers in the cache after the kill: {[p.name for p in layers]}")

    restarted = generate(model, PROMPTS, kt=settings, max_tokens=16)
    fresh = generate(model, PROMPTS, kt={**settings, "KT_CACHE_DIR": str(tmp_path / "fresh")}, max_tokens=16)
    assert [r["ids"] for r in restarted] == [r["ids"] for r in fresh]
    assert len(list((tmp_path / "cache").glob(f"*/*/_layer_*/{MARKER}"))) == 3  # every MoE layer cached now
