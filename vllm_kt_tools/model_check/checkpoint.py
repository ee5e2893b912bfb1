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
from vllm_kt_tools.support.tiny_models import CHAT_TEMPLATE, train, write_tokenizer

# Bump when recipes, shapes or weights change: cached models are keyed by it.
CHECKPOINT_VERSION = 3
# Random weights leave near-uniform logits (the tiny Qwen3-MoE's greedy steps at -4.2 with
# three tokens within 0.02: another kernel's rounding picks any of them), so the models are
# trained briefly on the tiny models' text (``tiny_models.train``), as the end-to-end tests'
# are: they then predict their prompts' continuations with wide margins.
TRAIN_STEPS = 200
# Where transformers' model class cannot train (on this CPU, in this time), random weights
# with this std instead of initializer_range's 0.02: their logits spread more.
WEIGHT_STD = 0.1
# Recipe fields out of its repr that shape the checkpoint (tokenizer, processor config).
INPUT_FIELDS = ("image_processor", "special_tokens", "named_tokens", "token_ids", "transposed")
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
        # the text config's model_type too: some outer classes (Aria's) build a text config of a dict only with it
        kept = {"vocab_size": vocab_size, **{k: v for k, v in text_defaults.items() if k == "model_type"}}
        kwargs = {"text_config": _changed(text_defaults, text) | kept, **recipe.outer}
    else:
        values = {**shrink(defaults, recipe.layers), **recipe.config, **tokens}
        kwargs = {**_changed(defaults, values), **recipe.outer}
    config = AutoConfig.for_model(recipe.model_type, **kwargs)
    config.architectures = [architecture]
    return config


def train_steps(recipe: Recipe) -> int:
    """The recipe's own training steps, else TRAIN_STEPS."""
    return recipe.train_steps or TRAIN_STEPS


def _model_class(architecture: str, recipe: Recipe) -> Any:
    import transformers

    return getattr(transformers, recipe.hf_class or architecture)


def _randomize(model: Any, seed: int) -> None:
    """Redraw every weight matrix with std WEIGHT_STD (norms, biases and special
    parameters keep transformers' initialisation)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() >= 2 and "norm" not in name:
                param.copy_(torch.randn(param.shape, generator=gen) * WEIGHT_STD)


def _router_biases(model: Any, seed: int) -> None:
    """The routers' correction biases get random values and are made persistent, so that
    ``save_pretrained`` writes them under the checkpoint's own names (transformers keeps
    them as unsaved buffers; vLLM loads them)."""
    import torch

    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for module in model.modules():
            for name, buf in module.named_buffers(recurse=False):
                if name.endswith("e_score_correction_bias"):
                    buf.copy_(torch.randn(buf.shape, generator=gen) * 0.1)
                    module._non_persistent_buffers_set.discard(name)


def renamed(name: str, renames: dict[str, str | None] | Any) -> str | None:
    """``name`` with each of ``renames``' parts replaced by its value; None where a part
    maps to None (a tensor the released checkpoint lacks: dropped)."""
    for part, new in renames.items():
        if part in name and new is None:
            return None
        name = name.replace(part, new) if new is not None else name
    return name


def rename_tensors(out: Path, renames: Any) -> None:
    """Rewrite the saved safetensors (and their index) with ``renamed`` tensor names."""
    from safetensors.torch import load_file, save_file

    for path in sorted(out.glob("*.safetensors")):
        tensors = {renamed(k, renames): v for k, v in load_file(path).items()}
        save_file({k: v for k, v in tensors.items() if k is not None}, path, metadata={"format": "pt"})
    index = out / "model.safetensors.index.json"
    if index.exists():
        data = json.loads(index.read_text())
        weights = {renamed(k, renames): v for k, v in data["weight_map"].items()}
        data["weight_map"] = {k: v for k, v in weights.items() if k is not None}
        index.write_text(json.dumps(data, indent=2))


def with_config_json(written: dict[str, Any], extra: Any) -> dict[str, Any]:
    """The written config.json with a recipe's ``config_json``: a dict value (a text_config's
    keys) is merged into the written dict of that key, another value replaces it, None removes it."""
    merged = {
        **written,
        **{
            key: {**written[key], **value} if isinstance(value, dict) and isinstance(written.get(key), dict) else value
            for key, value in extra.items()
        },
    }
    return {key: value for key, value in merged.items() if value is not None}


def transpose_tensors(out: Path, parts: tuple[str, ...]) -> None:
    """Rewrite the saved safetensors with the last two dimensions of every tensor whose name
    holds one of ``parts`` swapped."""
    from safetensors.torch import load_file, save_file

    for path in sorted(out.glob("*.safetensors")):
        tensors = load_file(path)
        swapped = {k: v.transpose(-2, -1).contiguous() if any(p in k for p in parts) else v for k, v in tensors.items()}
        save_file(swapped, path, metadata={"format": "pt"})


def add_special_tokens(out: Path, tokens: tuple[str, ...], named: Any = None) -> int:
    """The tiny tokenizer in ``out`` with ``tokens`` added as special tokens, and ``named``'s
    (attribute -> token: transformers' extra special tokens) too; its size."""
    from transformers import AutoTokenizer

    write_tokenizer(out)
    tokenizer = AutoTokenizer.from_pretrained(out, extra_special_tokens=dict(named or {}))
    tokenizer.add_special_tokens({"additional_special_tokens": [*tokens, *dict(named or {}).values()]})
    tokenizer.save_pretrained(out)
    return len(tokenizer)


def write_checkpoint(architecture: str, out_dir: str | Path, seed: int = 0) -> Path:
    """The tiny ``architecture`` model of its recipe, in ``out_dir``."""
    import torch

    recipe = RECIPES[architecture]
    torch.set_num_threads(1)  # a tiny model: more threads only contend on a busy machine
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    added = recipe.special_tokens or recipe.named_tokens
    vocab_size = add_special_tokens(out, recipe.special_tokens, recipe.named_tokens) if added else write_tokenizer(out)
    config = build_config(architecture, recipe, vocab_size)
    for key, token in recipe.token_ids.items():
        setattr(config, key, tokenizer_of(out).convert_tokens_to_ids(token))
    torch.manual_seed(seed)
    model = _model_class(architecture, recipe)._from_config(config, dtype=torch.float32)
    _router_biases(model, seed)
    steps = train_steps(recipe)
    weights = f"trained {steps} steps"
    try:
        loss = train(model, tokenizer_of(out), steps, seed, batch=8, window=32)
        weights += f", loss {loss:.2f}"
    except Exception as error:  # noqa: BLE001 - transformers' class cannot train here: random weights
        torch.manual_seed(seed)
        model = _model_class(architecture, recipe)._from_config(config, dtype=torch.float32)
        _router_biases(model, seed)
        _randomize(model, seed)
        weights = f"random, std {WEIGHT_STD} (training failed: {type(error).__name__}: {str(error)[:200]})"
    model.to(torch.bfloat16)
    model.config.dtype = "bfloat16"
    model.config.architectures = [architecture]
    model.save_pretrained(out, safe_serialization=True)
    name_architecture(out, architecture)
    if recipe.renames:
        rename_tensors(out, recipe.renames)
    if recipe.transposed:
        transpose_tensors(out, recipe.transposed)
    folder = weights_folder(architecture)
    if folder:
        (out / folder).mkdir(exist_ok=True)
        for path in [*out.glob("*.safetensors"), *out.glob("model.safetensors.index.json")]:
            path.rename(out / folder / path.name)
    if recipe.config_json:
        merged = with_config_json(json.loads((out / "config.json").read_text()), recipe.config_json)
        (out / "config.json").write_text(json.dumps(merged, indent=2))
    if recipe.image_processor:
        write_processor(out, recipe.image_processor, recipe.model_type)
    (out / "generation_config.json").write_text(json.dumps({"bos_token_id": 0, "eos_token_id": 4, "do_sample": False}))
    (out / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    (out / "MODEL_CHECK.json").write_text(
        json.dumps({"architecture": architecture, "version": CHECKPOINT_VERSION, "weights": weights})
    )
    return out


# The released Diffusers layout's folders (Cosmos3-Edge's checkpoint: transformer/, vision_encoder/)
DIFFUSERS_FOLDERS = ("transformer", "vision_encoder")


def weights_folder(architecture: str) -> str | None:
    """Where vLLM's model class of ``architecture`` reads weights only from sub-folders (its
    ``allow_patterns_overrides``: the released Diffusers layout), the first of DIFFUSERS_FOLDERS
    they match, which the tiny model's safetensors go to; else None (the top folder)."""
    from fnmatch import fnmatch

    from vllm_kt_tools.support import vllm_internals

    try:
        patterns = getattr(vllm_internals.model_class(architecture), "allow_patterns_overrides", None) or []
    except Exception:  # noqa: BLE001 - a module that does not import here: plain vLLM will say so
        return None
    folders = [f for f in DIFFUSERS_FOLDERS if any(fnmatch(f"{f}/model.safetensors", p) for p in patterns)]
    return folders[0] if folders else None


# A processor's parts -> transformers' auto mapping naming each model_type's class of that part.
_PART_MAPPINGS = {
    "image_processor": "image_processing_auto.IMAGE_PROCESSOR_MAPPING_NAMES",
    "feature_extractor": "feature_extraction_auto.FEATURE_EXTRACTOR_MAPPING_NAMES",
    "video_processor": "video_processing_auto.VIDEO_PROCESSOR_MAPPING_NAMES",
}


def processor_part(part: str, model_type: str) -> Any:
    """transformers' default ``part`` (image processor, feature extractor, video processor) of
    ``model_type``: its torchvision class where it names one per backend."""
    import importlib

    import transformers

    module, mapping = _PART_MAPPINGS[part].rsplit(".", 1)
    names = getattr(importlib.import_module(f"transformers.models.auto.{module}"), mapping)[model_type]
    name = (names.get("torchvision") or names["pil"]) if isinstance(names, dict) else names
    return getattr(transformers, name)()


def write_processor(out: Path, name: str, model_type: str) -> None:
    """The config of transformers' class ``name`` in ``out``: an image processor's alone, or a
    processor's with its parts' defaults for ``model_type`` (where two parts would write the same
    preprocessor_config.json, e.g. an image processor and an audio feature extractor)."""
    import transformers

    cls = getattr(transformers, name)
    if not issubclass(cls, transformers.ProcessorMixin):
        cls().save_pretrained(out)
        return
    parts = {
        part: tokenizer_of(out) if part == "tokenizer" else processor_part(part, model_type)
        for part in cls.get_attributes()
    }
    cls(**parts).save_pretrained(out)


def name_architecture(out: Path, architecture: str) -> None:
    """config.json names ``architecture``: transformers' save_pretrained writes its model class's
    name there, which vLLM resolves instead where the recipe's ``hf_class`` is another class."""
    path = out / "config.json"
    config = json.loads(path.read_text())
    if config.get("architectures") != [architecture]:
        path.write_text(json.dumps({**config, "architectures": [architecture]}, indent=2))


def tokenizer_of(model_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


def weights_of(model_dir: Path) -> str:
    """How the checkpoint's weights were made (MODEL_CHECK.json)."""
    return str(json.loads((model_dir / "MODEL_CHECK.json").read_text()).get("weights", ""))


def checkpoint_dir(architecture: str, root: str | Path) -> Path:
    """``root/<architecture>-<hash of its recipe and CHECKPOINT_VERSION>``, written on first use."""
    recipe = RECIPES[architecture]
    made = f"{CHECKPOINT_VERSION} {WEIGHT_STD} {train_steps(recipe)} {recipe!r}"
    inputs = {name: getattr(recipe, name) for name in INPUT_FIELDS if getattr(recipe, name)}
    if inputs:  # only where set: the other recipes' keys stay as they were
        made += f" {inputs!r}"
    key = hashlib.sha256(made.encode()).hexdigest()[:10]
    out = Path(root) / f"{architecture}-{key}"
    if not (out / "MODEL_CHECK.json").exists():
        write_checkpoint(architecture, out)
    name_architecture(out, architecture)  # one cached before it named the architecture: the weights stand
    return out
