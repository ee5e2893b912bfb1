"""A mistake in a KT_* variable, or CPU-expert weights kt-kernel cannot use, stops
`vllm serve` before any weight is loaded, with a line naming the variable, the value and
what is allowed (for broken weights: the layer, the expert and the file)."""

from __future__ import annotations

import subprocess
import time

import pytest
from kt_testing.broken_weights import BREAKAGES, broken_copy
from kt_testing.engines import clean_env
from kt_testing.hardware import skip_without_kernel

from vllm_kt_tools.support.server import vllm_command

pytestmark = pytest.mark.engine


@pytest.mark.parametrize(
    "variable,value,expected",
    [
        ("KT_NUM_GPU_EXPERTS", "99", "KT_NUM_GPU_EXPERTS='99' is invalid (the model has 8 routed experts per layer)"),
        ("KT_CPUINFER", "many", "KT_CPUINFER='many' is invalid (not an integer); allowed: a positive integer"),
        ("KT_BACKEND", "cuda", "KT_BACKEND='cuda' is invalid"),
        # Refusals that need the model's config, made in the API-server process too (kt-kernel's
        # AMXINT4 tiles need sizes in multiples of 128, the tiny model's experts are 64 wide;
        # auto has no GPU to size to on vLLM's CPU build). AMXINT4 was once refused in a worker
        # after the weights loaded, 64 s in, inside a 243-line log.
        ("KT_METHOD", "AMXINT4", "KT_METHOD='AMXINT4' is invalid"),
        ("KT_NUM_GPU_EXPERTS", "auto", "KT_NUM_GPU_EXPERTS='auto' is invalid"),
    ],
)
def test_vllm_serve_stops_with_one_clear_line(tiny_model, variable: str, value: str, expected: str) -> None:
    assert_stops_before_weights(tiny_model("qwen3_moe"), {variable: value}, expected)


@pytest.mark.parametrize("kind", sorted(BREAKAGES))
def test_broken_cpu_expert_weights_stop_vllm_serve(tiny_model, tmp_path, kind: str) -> None:
    """KT_WEIGHT_PATH with a wrong-shaped expert tensor (kt-kernel would read it as if it
    were right), a missing one, or a truncated file: one line naming layer, expert, file."""
    model = tiny_model("qwen3_moe")
    broken = broken_copy(model, tmp_path / "weights", kind)
    settings = {"KT_METHOD": "BF16", "KT_WEIGHT_PATH": str(broken), "KT_NUM_GPU_EXPERTS": "4"}
    assert_stops_before_weights(model, settings, BREAKAGES[kind])


def test_an_architecture_the_chosen_backend_cannot_compute_stops_vllm_serve(tiny_model, tmp_path) -> None:
    """gpt-oss (biased experts, clamped SwiGLU) with KT_BACKEND=kt_kernel set is refused from
    its config, in the front end: a config and tokenizer are all it takes
    (vllm_kt_plugin/architectures.py; unset, the torch backend serves it: docs/supported_models.md)."""
    import shutil

    import transformers

    config = transformers.GptOssConfig(
        vocab_size=512,
        hidden_size=128,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        num_local_experts=8,
        num_experts_per_tok=2,
        max_position_embeddings=512,
        architectures=["GptOssForCausalLM"],
    )
    config.save_pretrained(tmp_path)
    for tokenizer_file in tiny_model("qwen3_moe").glob("tokenizer*"):
        shutil.copy(tokenizer_file, tmp_path)
    expected = "--quantization='kt-hybrid' is invalid (GptOssForCausalLM: gpt-oss's experts have biases"
    assert_stops_before_weights(tmp_path, {"KT_BACKEND": "kt_kernel"}, expected)


def test_a_gguf_that_does_not_match_the_model_stops_vllm_serve(tiny_model, tmp_path) -> None:
    """KT_METHOD=LLAMAFILE with a GGUF that lacks the model's last MoE layer: refused from the
    GGUF's header in the API-server process, the line naming the file and the tensor (each
    other refusal of the GGUF check: tests/unit/test_gguf_files.py)."""
    from vllm_kt_tools.support.gguf_export import write_random_experts

    model = tiny_model("qwen3_moe", gguf_experts=True)  # 3 MoE layers, 8 experts, hidden 256, width 256
    gguf = write_random_experts(tmp_path / "experts-Q8_0.gguf", [0, 1], 8, 256, 256, "Q8_0")
    expected = f"KT_WEIGHT_PATH='{gguf}' is invalid (experts-Q8_0.gguf: no blk.2.ffn_gate_exps.weight"
    assert_stops_before_weights(model, {"KT_METHOD": "LLAMAFILE", "KT_WEIGHT_PATH": str(gguf)}, expected)


@pytest.mark.parametrize("method", ["AMXINT8", "BF16"])
def test_weights_the_method_cannot_read_stop_vllm_serve(tiny_model, tmp_path, method: str) -> None:
    """Issue 48: KT_METHOD=AMXINT8 with KT_WEIGHT_PATH set to the model's own BF16 folder
    passed the config and died in a worker, weights loaded, in kt-kernel's loader ("No experts
    found for key blk.0"). Now serve stops with the line naming what the folder holds, what
    AMXINT8 reads and the fix. And the mirror (this runs on any CPU; the first needs an AMXINT8
    kernel, checked before any path): BF16 with `kt quant`'s AMXINT8 output. Every other pair:
    tests/unit/test_weight_paths.py."""
    from vllm_kt_tools.support.kt_weight_layouts import convert_layers, fake_layers

    if method == "AMXINT8":
        skip_without_kernel("AMXINT8")
    model = tiny_model("qwen3_moe")
    if method == "AMXINT8":
        path = model.resolve()
        holds = "a Hugging Face checkpoint whose routed experts are BF16; KT_METHOD=AMXINT8 reads AMXINT8 experts"
        fix = "allowed: KT_WEIGHT_PATH unset, to quantize the checkpoint to AMXINT8 at the first start"
    else:
        path = convert_layers(fake_layers(model, tmp_path / "layers", "AMXINT8"), model, tmp_path, "AMXINT8").resolve()
        holds = "AMXINT8 experts converted by KTransformers"
        fix = "allowed: KT_METHOD=AMXINT8 for these weights"
    settings = {"KT_METHOD": method, "KT_WEIGHT_PATH": str(path)}
    assert_stops_before_weights(model, settings, f"KT_WEIGHT_PATH='{path}' is invalid ({holds}", fix)


def assert_stops_before_weights(model, settings: dict[str, str], *expected: str) -> None:
    """Refused in the API-server process (no engine core ever starts), and the last line of
    the output is the refusal, naming the variable (each of ``expected`` is in it); the time
    to it is printed (-s)."""
    start = time.monotonic()
    proc = subprocess.run(
        [*vllm_command(), "serve", str(model), "--quantization", "kt-hybrid"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,  # as a terminal shows them: interleaved
        text=True,
        env=clean_env(**settings),
        timeout=600,
    )
    elapsed = time.monotonic() - start
    output = proc.stdout
    assert proc.returncode != 0
    error_lines = [line for line in output.splitlines() if "ERROR" in line and "kt-hybrid: " in line]
    assert error_lines and all(part in error_lines[0] for part in expected), output[-3000:]
    assert "Loading weights" not in output and "EngineCore" not in output
    last = output.strip().splitlines()[-1]
    assert last.startswith("kt-hybrid: ") and all(part in last for part in expected), output[-3000:]
    print(f"{settings}: refused after {elapsed:.1f} s, last line: {last}")
