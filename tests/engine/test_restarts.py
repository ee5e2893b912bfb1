"""A start killed with SIGKILL while it quantizes the CPU experts online leaves nothing
half-written that counts as cached, and the next start finishes and serves the same
tokens as a start with an empty cache. Needs kt-kernel's AMXINT8 kernels (AVX-512/AMX)."""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest
from kt_testing.engines import PROMPTS, clean_env, generate
from kt_testing.hardware import requires_kernel

from vllm_kt_plugin.cpu_backends.kt_kernel.weight_cache import MARKER, layer_is_cached
from vllm_kt_tools.support.server import VLLMServer

pytestmark = [pytest.mark.engine, requires_kernel("AMXINT8")]

NUM_EXPERTS = 8
NUM_MOE_LAYERS = 3  # of the tiny Qwen3-MoE
KILL_ATTEMPTS = 3
_QUANTIZED = re.compile(r"\(quantized (\d+) of (\d+) layers\)")


def kill_when_quantizing(model: Path, settings: dict[str, str], log: Path) -> str:
    """Start `vllm serve` and SIGKILL its process group as soon as the log reports the
    first quantized layer; return the log as it stood at the kill."""
    server = VLLMServer(model, ["--max-model-len", "256", "--quantization", "kt-hybrid"], clean_env(**settings), log)
    server.launch()
    deadline = time.monotonic() + 600
    try:
        while time.monotonic() < deadline:
            text = log.read_text(errors="replace")
            if _QUANTIZED.search(text):
                server.kill()
                return log.read_text(errors="replace")
            assert server.proc is not None and server.proc.poll() is None, text[-3000:]
            time.sleep(0.02)
    finally:
        server.kill()
    raise AssertionError("no layer was quantized within 600 s:\n" + log.read_text()[-3000:])


def quantized_before_the_kill(log: str) -> tuple[int, int]:
    """(layers quantized, layers in all) by the last progress line before the kill."""
    done, total = _QUANTIZED.findall(log)[-1]
    return int(done), int(total)


def test_start_killed_while_quantizing_then_restarted(tiny_model, tmp_path: Path) -> None:
    model = tiny_model("qwen3_moe")
    for attempt in range(KILL_ATTEMPTS):  # until the kill lands before the last layer is written
        cache = tmp_path / f"cache-{attempt}"
        settings = {"KT_METHOD": "AMXINT8", "KT_NUM_GPU_EXPERTS": "4", "KT_CACHE_DIR": str(cache)}
        log = kill_when_quantizing(model, settings, tmp_path / f"killed-{attempt}.log")
        done, total = quantized_before_the_kill(log)
        written = sorted(cache.glob(f"*/*/_layer_*/{MARKER}"))
        print(f"attempt {attempt}: killed after {done} of {total} layers quantized; {len(written)} marked cached")
        if done < total and len(written) < NUM_MOE_LAYERS:
            break
    assert total == NUM_MOE_LAYERS
    assert done < total and len(written) < NUM_MOE_LAYERS, f"every kill came too late ({KILL_ATTEMPTS} tries)"
    layers = sorted(cache.glob("*/*/_layer_*"))
    for layer_dir in layers:  # what the kill left: a layer that looks cached is complete
        index = int(layer_dir.name.removeprefix("_layer_"))
        if (layer_dir / MARKER).exists():
            assert layer_is_cached(layer_dir.parent, index, NUM_EXPERTS), layer_dir
    print(f"layers in the cache after the kill: {[p.name for p in layers]}")

    restarted = generate(model, PROMPTS, kt=settings, max_tokens=16)
    fresh = generate(model, PROMPTS, kt={**settings, "KT_CACHE_DIR": str(tmp_path / "fresh")}, max_tokens=16)
    assert [r["ids"] for r in restarted] == [r["ids"] for r in fresh]
    assert len(list(cache.glob(f"*/*/_layer_*/{MARKER}"))) == NUM_MOE_LAYERS  # every MoE layer cached now
