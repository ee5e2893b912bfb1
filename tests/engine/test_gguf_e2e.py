"""GGUF experts end to end (KT_METHOD=LLAMAFILE): tiny Qwen3-MoE and DeepSeek-V3 (hidden
size and expert width 256, the grid kt-kernel's llamafile kernels compute on), their routed
experts exported to GGUF here as llama.cpp names and stores them
(``vllm_kt_tools.support.gguf_export``: gguf-py's Q8_0 and Q4_0), served from the Hugging
Face checkpoint for everything else, against plain vLLM on the same checkpoint (greedy):
directly (vLLM's LLM) and through `vllm serve` and the OpenAI client. Every expert is on the
CPU, so every routed expert comes from the GGUF; a GGUF whose experts are stored in reverse
order must fail the same comparison."""

from __future__ import annotations

from pathlib import Path

import pytest
from kt_testing.engines import PROMPTS, clean_env, differing, generate, generate_logged, logprob_drift
from kt_testing.hardware import requires_kernel

from vllm_kt_tools.support.gguf_export import export_gguf
from vllm_kt_tools.support.server import VLLMServer

pytestmark = [pytest.mark.engine, requires_kernel("LLAMAFILE")]

# Bounds per GGML type, against plain vLLM (BF16 experts) on the same checkpoint, 5 prompts x
# 24 greedy tokens: the largest chosen-token logprob drift (teacher forcing past a parting,
# ``logprob_drift``; through the server: while the tokens agree), how many completions part
# somewhere, how many first tokens differ. Measured on the 2-core AMX box (kt-kernel amx
# kernels), 2026-12-06, `pytest -s tests/engine/test_gguf_e2e.py` (it prints them):
#   Q8_0: qwen3_moe direct 0.0001, deepseek_v3 served 0.0235; no parting, no first token differs;
#   Q4_0: deepseek_v3 direct 0.0625, qwen3_moe served 0.0004; no parting, no first token differs;
#   the permuted Q8_0 GGUF (negative control): 11.88, all 5 part at their first token.
# Bounds: twice the larger drift of each type (other kt-kernel builds and batch compositions
# round otherwise); no parting for Q8_0; for Q4_0 one completion may part, at its first token
# too (4-bit rounding can flip a near-tie the trained models do not show today).
DRIFT_BOUND = {"Q8_0": 0.05, "Q4_0": 0.125}
PARTED_BOUND = {"Q8_0": 0, "Q4_0": 1}
FIRST_TOKEN_BOUND = {"Q8_0": 0, "Q4_0": 1}
LOADED = "CPU experts (LLAMAFILE"  # the backend's load line (backend.py): the GGUF was read


def gguf_experts(model: Path, out: Path, type_name: str, **kwargs: object) -> list[Path]:
    """The model's GGUF, written once per test session."""
    path = out / f"{model.name}-{type_name}{'-permuted' if kwargs.get('permute_experts') else ''}.gguf"
    return export_gguf(model, path, type_name, **kwargs)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def plain_reference(tiny_model):
    """Plain vLLM's greedy completions, per architecture (one engine each)."""
    cache: dict[str, list] = {}

    def get(arch: str) -> list:
        if arch not in cache:
            cache[arch] = generate(tiny_model(arch, gguf_experts=True), PROMPTS, kt=None)
        return cache[arch]

    return get


@pytest.fixture(scope="module")
def gguf_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("gguf")


# How each case names its GGUF, as a user would: a file, a folder, llama.cpp's first split
# file; KT_METHOD=LLAMAFILE set, or left to follow the GGUF weights.
# Each architecture runs each type once, directly or through the server (engine starts are
# the CI's cost: 2 plain + 4 GGUF + 1 negative control).
CASES = [
    ("qwen3_moe", "Q8_0", "file", {"KT_METHOD": "LLAMAFILE"}),
    ("deepseek_v3", "Q4_0", "folder", {}),
]
SERVED = [("qwen3_moe", "Q4_0", "split"), ("deepseek_v3", "Q8_0", "file")]


def weight_path(files: list[Path], form: str) -> str:
    """KT_WEIGHT_PATH as the case names it: the folder, or the (first) file."""
    return str(files[0].parent if form == "folder" else files[0])


def assert_tracks(arch: str, type_name: str, got: list, want: list) -> None:
    drift, parted = logprob_drift(got, want), differing(got, want)
    first = sum(g["ids"][0] != w["ids"][0] for g, w in zip(got, want, strict=True))
    print(
        f"{arch} {type_name}: drift {drift:.4f}, {parted} of {len(want)} completions part, {first} first tokens differ"
    )
    assert drift <= DRIFT_BOUND[type_name], f"{arch} {type_name}: drift {drift:.4f} > {DRIFT_BOUND[type_name]}"
    assert parted <= PARTED_BOUND[type_name], f"{arch} {type_name}: {parted} completions part"
    assert first <= FIRST_TOKEN_BOUND[type_name], f"{arch} {type_name}: {first} first tokens differ"


@pytest.mark.parametrize(("arch", "type_name", "form", "kt"), CASES, ids=[f"{a}-{t}-{f}" for a, t, f, _ in CASES])
def test_gguf_experts_track_plain_vllm(
    tiny_model, plain_reference, gguf_dir: Path, arch: str, type_name: str, form: str, kt: dict[str, str]
) -> None:
    model = tiny_model(arch, gguf_experts=True)
    folder = gguf_dir / f"{arch}-{type_name}-{form}"
    files = gguf_experts(model, folder, type_name)
    want = plain_reference(arch)
    got, log = generate_logged(model, PROMPTS, kt={**kt, "KT_WEIGHT_PATH": weight_path(files, form)}, reference=want)
    assert LOADED in log and "method=LLAMAFILE" in log, log[-3000:]
    assert_tracks(arch, type_name, got, want)


def test_permuted_gguf_experts_fail(tiny_model, plain_reference, gguf_dir: Path) -> None:
    """Negative control: the same Q8_0 experts stored in reverse expert order (a loader that
    ignored the order would pass) fail the Q8_0 comparison."""
    model = tiny_model("qwen3_moe", gguf_experts=True)
    files = gguf_experts(model, gguf_dir / "permuted", "Q8_0", permute_experts=True)
    want = plain_reference("qwen3_moe")
    got = generate(model, PROMPTS, kt={"KT_WEIGHT_PATH": str(files[0])}, reference=want)
    with pytest.raises(AssertionError):
        assert_tracks("qwen3_moe", "Q8_0", got, want)


def served_completions(model: Path, env: dict[str, str], log: Path) -> list[dict]:
    """`vllm serve` with kt-hybrid and these settings; greedy completions of PROMPTS with
    their chosen-token logprobs through the OpenAI client."""
    from openai import OpenAI

    args = ["--served-model-name", "tiny-moe", "--max-model-len", "256", "--quantization", "kt-hybrid"]
    with VLLMServer(model, args, env=clean_env(**env), log_path=log) as server:
        client = OpenAI(base_url=f"{server.base_url}/v1", api_key="EMPTY")
        out = []
        for prompt in PROMPTS:
            choice = client.completions.create(
                model="tiny-moe",
                prompt=prompt,
                max_tokens=24,
                temperature=0.0,
                logprobs=1,
                extra_body={"ignore_eos": True, "return_token_ids": True},
            ).choices[0]
            out.append({"ids": choice.model_extra["token_ids"], "logprobs": choice.logprobs.token_logprobs})
    return out


@pytest.mark.parametrize(("arch", "type_name", "form"), SERVED, ids=[f"{a}-{t}-{f}" for a, t, f in SERVED])
def test_openai_server_serves_gguf_experts(
    tiny_model, plain_reference, gguf_dir: Path, tmp_path: Path, arch: str, type_name: str, form: str
) -> None:
    """The user's command: `vllm serve HF_DIR --quantization kt-hybrid` with KT_WEIGHT_PATH
    at the GGUF (a file, or llama.cpp's first split file); the OpenAI client's greedy tokens
    and logprobs against plain vLLM's, within the type's bounds while the tokens agree."""
    model = tiny_model(arch, gguf_experts=True)
    files = gguf_experts(model, gguf_dir / f"{arch}-{type_name}-{form}", type_name, splits=3 if form == "split" else 1)
    want = plain_reference(arch)
    if form == "split":
        assert [f.name for f in files][-1].endswith("-00003-of-00003.gguf")
    got = served_completions(model, {"KT_WEIGHT_PATH": str(files[0])}, tmp_path / "serve.log")
    log = (tmp_path / "serve.log").read_text()
    assert LOADED in log, log[-3000:]
    parted, first, drift = 0, 0, 0.0
    for g, w in zip(got, want, strict=True):
        agree = next((i for i, (a, b) in enumerate(zip(g["ids"], w["ids"], strict=True)) if a != b), len(w["ids"]))
        parted += agree < len(w["ids"])
        first += agree == 0
        drift = max([drift, *(abs(g["logprobs"][i] - w["top2"][i][0]) for i in range(agree))])
    print(f"served {arch} {type_name}: drift {drift:.4f} while the tokens agree, {parted} part, {first} first differ")
    assert drift <= DRIFT_BOUND[type_name] and parted <= PARTED_BOUND[type_name]
    assert first <= FIRST_TOKEN_BOUND[type_name]
