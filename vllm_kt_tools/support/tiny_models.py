"""Tiny random MoE checkpoints, written locally, for the demo and the tests.

Nothing can be downloaded from a model hub on CI machines, so every checkpoint is
created here: a byte-level BPE tokenizer trained on a built-in text, a model built with
transformers, trained for a few seconds until it knows that text (and a few chat
answers) by heart, and saved in Hugging Face format (BF16 safetensors).

Why train: an untrained random model has near-tied logits, so greedy decoding flips on
any re-association of a bf16 sum. A model that has learned its text predicts it with
wide margins, so "same tokens as plain vLLM" is a sharp test: exact arithmetic passes,
a missing or misrouted expert fails (tests/ check both). Shapes satisfy vLLM's CPU
kernels (dimensions divisible by 32, MLA head 512 + 64) and kt-kernel's BF16 kernel.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ARCHITECTURES = ("qwen3_moe", "mixtral", "deepseek_v3", "glm4_moe", "qwen2_moe")
# Bump when the text, shapes or training change: cached models are keyed by it.
GENERATOR_VERSION = 2

_TEXT = """\
The quick brown fox jumps over the lazy dog. A mixture of experts routes every token
to a few experts out of many, so a huge model computes like a small one. Experts that
are used often stay on the GPU; the others run on the CPU with AMX and AVX-512 kernels.
vLLM serves large language models with paged attention and continuous batching.
KTransformers keeps attention and hot experts on the GPU while CPU kernels compute the
rest. Once upon a time there was a small model that learned one page of text by heart
and answered every question from it. 0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20
"""

# (question, answer) pairs the tiny model learns in the chat format below.
_CHATS = (
    ("What is the capital of France?", "Paris is the capital of France."),
    ("Who computes the CPU experts?", "kt-kernel computes the CPU experts with AMX and AVX-512 kernels."),
    ("What does vLLM do?", "vLLM serves large language models with paged attention."),
    ("Say hello.", "Hello! I am a tiny mixture of experts model."),
)

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>{{ message['content'] }}<|end|>"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)

_INIT_STD = 0.02
_COMMON: dict[str, Any] = {
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
    "initializer_range": _INIT_STD,
    "tie_word_embeddings": False,
    "rms_norm_eps": 1e-6,
}


# Quantizable shapes: every linear layer's widths a multiple of 128, as block-FP8 (128 x 128
# blocks), GPTQ (groups of 128) and kt-kernel's AMXINT4 tiles need: 64-wide heads (the
# 2 KV heads' projection is 128) and 128-wide experts; for MLA, DeepSeek-V3's own head
# widths (nope 128, v 128), the ones vLLM's GPU MLA prefill kernels take.
QUANTIZABLE = {"head_dim": 64, "moe_intermediate_size": 128, "qk_nope_head_dim": 128, "v_head_dim": 128}


# GGUF experts (kt-kernel's LLAMAFILE): hidden size and expert width in whole 256-wide blocks
# (its llamafile kernels return zeros for hidden 128 and wrong sums for 384: measured).
GGUF_WIDE = {"hidden_size": 256, "moe_intermediate_size": 256}
# YaRN with factor 1 is plain RoPE (same math in transformers and vLLM), but vLLM then computes
# it in PyTorch: its CPU rotary kernel (the "default" rope type) mis-rotates the strided 3-D
# q_pe/k_pe tensors MLA hands it. Every MLA tiny model (and model-check recipe) uses it.
PLAIN_ROPE_AS_YARN = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 1.0,
    "original_max_position_embeddings": 512,
    "beta_fast": 32,
    "beta_slow": 1,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
}


def _arch_config(
    arch: str, vocab_size: int, num_experts: int, top_k: int, quantizable: bool = False, wide: dict | None = None
) -> Any:
    import transformers

    wide = wide if wide is not None else QUANTIZABLE if quantizable else {}
    common = {**_COMMON, "hidden_size": wide.get("hidden_size", _COMMON["hidden_size"])}
    if arch == "qwen3_moe":
        return transformers.Qwen3MoeConfig(
            **common,
            vocab_size=vocab_size,
            head_dim=wide.get("head_dim", 32),
            num_experts=num_experts,
            num_experts_per_tok=top_k,
            moe_intermediate_size=wide.get("moe_intermediate_size", 64),
            norm_topk_prob=True,
            decoder_sparse_step=1,
            mlp_only_layers=[],
        )
    if arch == "mixtral":
        if quantizable:
            raise ValueError("the tiny Mixtral has no quantizable variant (its experts are already 256 wide)")
        return transformers.MixtralConfig(
            **_COMMON,
            vocab_size=vocab_size,
            head_dim=32,
            num_local_experts=num_experts,
            num_experts_per_tok=top_k,
        )
    if arch == "deepseek_v3":
        common = {k: v for k, v in common.items() if k != "num_key_value_heads"}
        return transformers.DeepseekV3Config(
            **common,
            vocab_size=vocab_size,
            num_key_value_heads=4,
            moe_intermediate_size=wide.get("moe_intermediate_size", 64),
            n_routed_experts=num_experts,
            n_shared_experts=1,
            num_experts_per_tok=top_k,
            n_group=2,
            topk_group=1,
            topk_method="noaux_tc",
            scoring_func="sigmoid",
            norm_topk_prob=True,
            routed_scaling_factor=2.5,
            first_k_dense_replace=1,
            kv_lora_rank=512,
            q_lora_rank=None,
            qk_rope_head_dim=64,
            qk_nope_head_dim=wide.get("qk_nope_head_dim", 32),
            v_head_dim=wide.get("v_head_dim", 32),
            rope_interleave=True,
            rope_parameters=dict(PLAIN_ROPE_AS_YARN),
        )
    if arch == "glm4_moe":  # GLM-4.5/4.6: shared expert, sigmoid routing with a bias, partial rotary
        if quantizable:
            raise ValueError("the tiny GLM-4.5 has no quantizable variant")
        return transformers.Glm4MoeConfig(
            **_COMMON,
            vocab_size=vocab_size,
            head_dim=32,
            moe_intermediate_size=64,
            n_routed_experts=num_experts,
            n_shared_experts=1,
            num_experts_per_tok=top_k,
            n_group=1,
            topk_group=1,
            norm_topk_prob=True,
            routed_scaling_factor=2.5,
            first_k_dense_replace=1,
            attention_bias=True,
            num_mtp_layers=0,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
        )
    if arch == "qwen2_moe":  # Qwen1.5/2-MoE: a shared expert behind a sigmoid gate, no top-k renormalisation
        if quantizable:
            raise ValueError("the tiny Qwen2-MoE has no quantizable variant")
        return transformers.Qwen2MoeConfig(
            **_COMMON,
            vocab_size=vocab_size,
            num_experts=num_experts,
            num_experts_per_tok=top_k,
            moe_intermediate_size=64,
            shared_expert_intermediate_size=128,
            norm_topk_prob=False,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            qkv_bias=True,
        )
    raise ValueError(f"unknown architecture {arch!r}; choose one of {ARCHITECTURES}")


def chat_prompt(question: str) -> str:
    """``question`` as the tiny models' chat template renders it for generation."""
    return f"<|user|>{question}<|end|><|assistant|>"


# The prompts the engine comparisons use (tests, model check): the training text's openings
# and one chat, which the tiny models continue with confidence.
PROMPTS = (
    "The quick brown fox",
    "A mixture of experts",
    "vLLM serves",
    "Once upon a time",
    chat_prompt("What is the capital of France?"),
)


def training_text() -> str:
    chats = "".join(f"{chat_prompt(q)}{a}<|end|>\n" for q, a in _CHATS)
    return _TEXT + chats


def write_tokenizer(out_dir: Path, vocab_size: int = 512) -> int:
    """Train a byte-level BPE tokenizer on the built-in text; return its size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    special = ["<|endoftext|>", "<|user|>", "<|assistant|>", "<|system|>", "<|end|>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=special,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,  # its bars printed blank lines in logs (the demo's silent minutes)
    )
    tok.train_from_iterator([training_text()], trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|endoftext|>",
        eos_token="<|end|>",
        pad_token="<|endoftext|>",
        unk_token="<|endoftext|>",
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out_dir)
    return len(fast)


def write_numbered_tokenizer(out_dir: Path, vocab_size: int) -> None:
    """A tokenizer whose tokens are "<0>" .. "<vocab_size-1>", split on spaces: text made of
    them encodes back to the same ids, for benchmarking a model shape without its real
    tokenizer (``vllm bench serve``'s random prompts are token ids decoded to text)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"<{i}>": i for i in range(vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<0>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins tokens with spaces
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<0>", eos_token="<1>").save_pretrained(out_dir)


def _set_router_bias(model: Any, seed: int) -> dict[str, Any]:
    """DeepSeek-V3's and GLM-4.5's routers add e_score_correction_bias before top-k. Give it
    non-zero values (so the tests exercise it) before training; return them by
    checkpoint name, since transformers does not save this buffer."""
    import torch

    gen = torch.Generator().manual_seed(seed + 1)
    biases = {}
    for name, buf in model.named_buffers():
        if name.endswith("mlp.gate.e_score_correction_bias"):
            buf.copy_(torch.randn(buf.shape, generator=gen) * 0.05)
            biases[name] = buf.detach().clone()
    return biases


# Called during training with (step, steps, loss): the demo and make-tiny-model show it, so
# that a slow (busy) machine is told apart from a hung one.
TrainingProgress = Callable[[int, int, float], None]
PROGRESS_EVERY_S = 5.0


def print_training_progress(step: int, steps: int, loss: float) -> None:
    """One updating line on a terminal, a line per call in logs."""
    line = f"      training step {step}/{steps}, loss {loss:.3f}"
    if sys.stdout.isatty():
        print(f"\r{line}", end="\n" if step == steps else "", flush=True)
    else:
        print(line, flush=True)


def train(
    model: Any,
    tokenizer: Any,
    steps: int,
    seed: int,
    progress: TrainingProgress | None = None,
    batch: int = 16,
    window: int = 64,
) -> float:
    """Teach ``model`` the built-in text (``batch`` windows of ``window`` tokens a step);
    return the last loss. ``progress`` hears the step and loss every PROGRESS_EVERY_S
    seconds and at the end."""
    import torch

    ids = torch.tensor(tokenizer(training_text())["input_ids"])
    window = min(window, len(ids) - 1)
    gen = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model.train()
    loss = torch.tensor(float("nan"))
    shown = time.monotonic()
    for step in range(1, steps + 1):
        starts = torch.randint(0, len(ids) - window, (batch,), generator=gen)
        windows = torch.stack([ids[i : i + window] for i in starts])
        loss = model(input_ids=windows, labels=windows).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if progress is not None and (step == steps or time.monotonic() - shown >= PROGRESS_EVERY_S):
            shown = time.monotonic()
            progress(step, steps, loss.item())
    model.eval()
    return loss.item()


def write_tiny_model(
    arch: str,
    out_dir: str | Path,
    *,
    num_experts: int = 8,
    top_k: int = 2,
    seed: int = 0,
    train_steps: int = 600,
    quantizable: bool = False,
    gguf_experts: bool = False,
    progress: TrainingProgress | None = None,
) -> Path:
    """Write a tiny ``arch`` MoE checkpoint (BF16 safetensors + tokenizer) to ``out_dir``;
    ``quantizable``: with the ``QUANTIZABLE`` shapes; ``gguf_experts``: 256-wide experts
    (``GGUF_WIDE``); ``progress``: told of the training."""
    import torch
    import transformers
    from safetensors.torch import load_file, save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    vocab_size = write_tokenizer(out)
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    config = _arch_config(arch, vocab_size, num_experts, top_k, quantizable, GGUF_WIDE if gguf_experts else None)
    config.bos_token_id = 0
    config.eos_token_id = tokenizer.convert_tokens_to_ids("<|end|>")
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    biases = _set_router_bias(model, seed)
    loss = train(model, tokenizer, train_steps, seed, progress)
    model.to(torch.bfloat16)
    model.config.dtype = "bfloat16"
    model.save_pretrained(out, safe_serialization=True)
    if biases:
        (weights,) = out.glob("*.safetensors")
        tensors = load_file(weights)
        tensors.update({name: b.to(torch.float32) for name, b in biases.items()})
        save_file(tensors, weights, metadata={"format": "pt"})
    (out / "generation_config.json").write_text(
        json.dumps({"bos_token_id": 0, "eos_token_id": config.eos_token_id, "do_sample": False})
    )
    (out / "TINY_MODEL.json").write_text(json.dumps({"arch": arch, "seed": seed, "steps": train_steps, "loss": loss}))
    return out


def tiny_model_dir(
    arch: str,
    root: str | Path,
    *,
    quantizable: bool = False,
    gguf_experts: bool = False,
    progress: TrainingProgress | None = None,
) -> Path:
    """``root/<arch>[-q128|-gguf]-v<GENERATOR_VERSION>``, written on first use."""
    suffix = "-q128" if quantizable else "-gguf" if gguf_experts else ""
    out = Path(root) / f"{arch}{suffix}-v{GENERATOR_VERSION}"
    if not (out / "TINY_MODEL.json").exists():
        write_tiny_model(arch, out, quantizable=quantizable, gguf_experts=gguf_experts, progress=progress)
    return out
