"""Write the tiny model of a recipe: tokenizer, config, random weights (BF16 safetensors).

The tokenizer is the tiny models' own (``support.tiny_models``): a byte-level BPE trained
on a built-in text, so no hub is needed. The weights are drawn by transformers' model
class (its own initialisation, biases and norms included) and saved with
``save_pretrained``, i.e. in the checkpoint layout vLLM's loaders read for that
architecture.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from vllm_kt_tools.model_check.recipes import RECIPES, Recipe, shrink
from vllm_kt_tools.support.tiny_models import CHAT_TEMPLATE, write_tokenizer

# Bump when recipes, shapes or weights change: cached models are keyed by it.
CHECKPOINT_VERSION = 1
# transformers' initialisation draws weights with std initializer_range (0.02); at hidden 128
# that leaves near-uniform logits, so greedy tokens would flip on rounding. This std spreads
# them (top-two gaps of tenths of a nat) and makes every expert's output count.
WEIGHT_STD = 0.1
_META = {"transformers_version", "architectures", "model_type", "_name_or_path", "dtype", "torch_dtype"}


def _changed(defaults: dict[str, Any], values: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in values.items() if k not in _META and defaults.get(k) != v}


def build_config(architecture: str, recipe: Recipe, vocab_size: int) -> Any:
    """The tiny config: the config class's defaults, shrunk, the recipe's overrides."""
    from transformers import AutoConfig

    defaults = AutoConfig.for_model(recipe.model_type).to_dict()
    tokens = {"vocab_size": vocab_size, "bos_token_id": 0, "eos_token_id": 4, "pad_token_id": 0}
    text_defaults = defaults.get("text_config")
    if isinstance(text_defaults, dict):
        text = {**shrink(text_defaults, recipe.layers), **recipe.config, **tokens}
        kwargs = {"text_config": _changed(text_defaults, text) | {"vocab_size": vocab_size}, **recipe.outer}
    else:
        values = {**shrink(defaults, recipe.layers), **recipe.config, **tokens}
        kwargs = {**_changed(defaults, values), **recipe.outer}
    config = AutoConfig.for_model(recipe.model_type, **kwargs)
    config.architectures = [architecture]
    return config


def _model_class(architecture: str, recipe: Recipe) -> Any:
    import transformers

    return getattr(transformers, recipe.hf_class or architecture)


def _randomize(model: Any, seed: int) -> None:
    """Redraw every weight matrix with std WEIGHT_STD (norms, biases and special
    parameters keep transformers' initialisation). The routers' correction biases get
    random values and are made persistent, so that ``save_pretrained`` writes them under
    the checkpoint's own names (transformers keeps them as unsaved buffers; vLLM loads
    them)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() >= 2 and "norm" not in name:
                param.copy_(torch.randn(param.shape, generator=gen) * WEIGHT_STD)
        for module in model.modules():
            for name, buf in module.named_buffers(recurse=False):
                if name.endswith("e_score_correction_bias"):
                    buf.copy_(torch.randn(buf.shape, generator=gen) * 0.1)
                    module._non_persistent_buffers_set.discard(name)


def write_checkpoint(architecture: str, out_dir: str | Path, seed: int = 0) -> Path:
    """The tiny ``architecture`` model of its recipe, in ``out_dir``."""
    import torch

    recipe = RECIPES[architecture]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    vocab_size = write_tokenizer(out)
    config = build_config(architecture, recipe, vocab_size)
    torch.manual_seed(seed)
    model = _model_class(architecture, recipe)._from_config(config, dtype=torch.float32)
    _randomize(model, seed)
    model.to(torch.bfloat16)
    model.config.dtype = "bfloat16"
    model.config.architectures = [architecture]
    model.save_pretrained(out, safe_serialization=True)
    (out / "generation_config.json").write_text(json.dumps({"bos_token_id": 0, "eos_token_id": 4, "do_sample": False}))
    (out / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    (out / "MODEL_CHECK.json").write_text(json.dumps({"architecture": architecture, "version": CHECKPOINT_VERSION}))
    return out


def checkpoint_dir(architecture: str, root: str | Path) -> Path:
    """``root/<architecture>-<hash of its recipe and CHECKPOINT_VERSION>``, written on first use."""
    key = hashlib.sha256(f"{CHECKPOINT_VERSION} {WEIGHT_STD} {RECIPES[architecture]!r}".encode()).hexdigest()[:10]
    out = Path(root) / f"{architecture}-{key}"
    if not (out / "MODEL_CHECK.json").exists():
        write_checkpoint(architecture, out)
    return out
