"""Online AMXINT4/AMXINT8 weights: quantize each layer's experts as vLLM loads them, and
keep the result on disk so the next start loads it without quantizing.

kt-kernel's ``load_weights_from_tensors`` quantizes a layer and writes it under its
``weight_path``; ``load_weights`` reads it back. One folder per model, method and NUMA pool
count; a layer is written to a temporary folder and renamed into place once complete, so
an interrupted start leaves no half-written layer. The layout: docs/design.md, "Online
AMX weights"."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from vllm_kt_plugin.cpu_backends.base import EXPERT_SHARDS, fill_dummy_experts
from vllm_kt_plugin.cpu_backends.kt_kernel.weight_paths import KT_FILE_NAME
from vllm_kt_plugin.settings.catalogue import LOGGER_NAME

logger = logging.getLogger(LOGGER_NAME)

MARKER = "vllm-kt.json"
DUMMY_SEED = 1234  # per layer: a cached dummy layer is the one the same start would quantize


def _model_fingerprint(model: str, model_dir: str | None) -> dict[str, Any]:
    """The model's weight files (names, sizes, times) in its local directory (a hub model's
    snapshot folder, whose path carries the commit), or "dummy" for random weights."""
    if model_dir is None:
        return {"model": model, "weights": "dummy"}
    files = [
        (path.name, path.stat().st_size, int(path.stat().st_mtime))
        for pattern in ("*.safetensors", "*.bin")
        for path in sorted(Path(model_dir).glob(pattern))
    ]
    return {"model": os.path.abspath(model_dir), "files": files}


def cache_folder(
    root: str, *, model: str, model_dir: str | None, method: str, pools: int, shape: tuple[int, int, int]
) -> Path:
    """Where this model's layers, quantized with ``method``, live (``model_dir`` None: dummy weights)."""
    key = {**_model_fingerprint(model, model_dir), "shape": shape}
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:12]
    name = re.sub(r"[^A-Za-z0-9._-]+", "_", Path(model.rstrip("/")).name)[:60] or "model"
    return Path(root) / f"{name}-{digest}" / f"{method}-pools{pools}"


FILES_PER_EXPERT = 6  # gate/up/down, each as quantized weights and scales


def layer_files_complete(layer_dir: Path, num_experts: int) -> bool:
    """kt-kernel writes ``_numa_<n>/<TYPE>_<proj>_<expert>_<bytes>Byte_<kind>_.kt`` and only
    prints when a write fails, so a full disk would leave short files behind: count the
    files and compare each size with the one in its name."""
    numa_dirs = sorted(layer_dir.glob("_numa_*"))
    if not numa_dirs:
        return False
    for numa in numa_dirs:
        files = list(numa.glob("*.kt"))
        if len(files) != FILES_PER_EXPERT * num_experts:
            return False
        for path in files:
            name = KT_FILE_NAME.match(path.name)
            if name is None or path.stat().st_size != int(name["bytes"]):
                return False
    return True


def layer_is_cached(folder: Path, layer_idx: int, num_experts: int) -> bool:
    layer_dir = folder / f"_layer_{layer_idx}"
    return (layer_dir / MARKER).is_file() and layer_files_complete(layer_dir, num_experts)


def layer_is_damaged(folder: Path, layer_idx: int, num_experts: int) -> bool:
    """A layer folder that exists but does not count as cached: files lost or cut short
    after it was published, or left unmarked by an older interrupted start."""
    return (folder / f"_layer_{layer_idx}").exists() and not layer_is_cached(folder, layer_idx, num_experts)


@dataclass
class ExpertTensors:
    """One layer's gate/up/down tensors for every expert, filled as vLLM loads them."""

    num_experts: int
    hidden_size: int
    intermediate_size: int
    gate: torch.Tensor = field(init=False)
    up: torch.Tensor = field(init=False)
    down: torch.Tensor = field(init=False)
    received: set[tuple[int, str]] = field(default_factory=set)

    def __post_init__(self) -> None:
        e, h, i = self.num_experts, self.hidden_size, self.intermediate_size
        self.gate = torch.empty(e, i, h, dtype=torch.bfloat16)
        self.up = torch.empty(e, i, h, dtype=torch.bfloat16)
        self.down = torch.empty(e, h, i, dtype=torch.bfloat16)

    def put(self, expert_id: int, shard_id: str, tensor: torch.Tensor) -> None:
        target = {"w1": self.gate, "w3": self.up, "w2": self.down}.get(shard_id)
        if target is None:
            raise ValueError(f"kt-hybrid: expert shard {shard_id!r} is not gate (w1), up (w3) or down (w2)")
        if tuple(tensor.shape) != tuple(target.shape[1:]):
            raise ValueError(
                f"kt-hybrid: expert {expert_id} {shard_id} has shape {tuple(tensor.shape)}, "
                f"expected {tuple(target.shape[1:])}"
            )
        target[expert_id].copy_(tensor)
        self.received.add((expert_id, shard_id))

    @property
    def complete(self) -> bool:
        return len(self.received) == self.num_experts * len(EXPERT_SHARDS)

    def missing(self) -> int:
        return self.num_experts * len(EXPERT_SHARDS) - len(self.received)

    def fill_dummy(self, layer_idx: int) -> None:
        """Random weights (``fill_dummy_experts``), the same for a layer at every start."""
        gen = torch.Generator().manual_seed(DUMMY_SEED + layer_idx)
        for tensor in (self.gate, self.up, self.down):
            fill_dummy_experts(tensor, gen)
        self.received = {(e, s) for e in range(self.num_experts) for s in EXPERT_SHARDS}


STALE_STAGING_S = 6 * 3600  # staging folders left by a killed start


def quantize_into_cache(
    kt_kernel: Any, folder: Path, layer_idx: int, tensors: ExpertTensors, **wrapper_args: Any
) -> None:
    """Quantize one layer with kt-kernel and publish it under ``folder`` atomically; a layer
    another process published meanwhile is kept (theirs is as good as ours)."""
    folder.mkdir(parents=True, exist_ok=True)
    _remove_stale_staging(folder)
    staging = Path(tempfile.mkdtemp(prefix=f".layer_{layer_idx}-", dir=folder))
    target = folder / f"_layer_{layer_idx}"
    try:
        wrapper = kt_kernel.KTMoEWrapper(layer_idx=layer_idx, weight_path=str(staging), **wrapper_args)
        physical_to_logical = torch.arange(tensors.num_experts, dtype=torch.long)
        wrapper.load_weights_from_tensors(tensors.gate, tensors.up, tensors.down, physical_to_logical)
        del wrapper
        written = staging / f"_layer_{layer_idx}"
        if not layer_files_complete(written, tensors.num_experts):
            raise RuntimeError(
                f"kt-kernel wrote an incomplete layer under {staging} (disk full or not writable?); "
                "free space in KT_CACHE_DIR or point it elsewhere"
            )
        (written / MARKER).write_text(
            json.dumps({"method": wrapper_args.get("method"), "created": time.time(), **_shape(tensors)})
        )
        if layer_is_cached(folder, layer_idx, tensors.num_experts):
            return
        if target.exists():  # a stale, unmarked layer from an interrupted start
            shutil.rmtree(target)
        try:
            os.replace(written, target)
        except OSError:
            if not layer_is_cached(folder, layer_idx, tensors.num_experts):
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _remove_stale_staging(folder: Path) -> None:
    for path in folder.glob(".layer_*-*"):
        try:
            if time.time() - path.stat().st_mtime > STALE_STAGING_S:
                shutil.rmtree(path, ignore_errors=True)
        except OSError:
            pass


def _shape(tensors: ExpertTensors) -> dict[str, int]:
    return {
        "num_experts": tensors.num_experts,
        "hidden_size": tensors.hidden_size,
        "intermediate_size": tensors.intermediate_size,
    }


class LoadProgress:
    """Per-layer progress lines ("(k/N)") for online quantization and for loading, and the
    total time once every layer is ready."""

    def __init__(self) -> None:
        self.layers = self.ready = self.quantized = 0
        self.started: float | None = None

    def expect_layer(self) -> None:
        self.layers += 1

    def _start(self, seconds: float) -> None:
        if self.started is None:
            self.started = time.perf_counter() - seconds

    def layer_quantized(self, layer_name: str, detail: str, seconds: float) -> None:
        self._start(seconds)
        self.quantized += 1
        logger.info(
            "kt-hybrid: %s: %s in %.2f s (quantized %d of %d layers)",
            layer_name,
            detail,
            seconds,
            self.quantized,
            self.layers,
        )

    def layer_ready(self, layer_name: str, detail: str, seconds: float) -> None:
        self._start(seconds)
        self.ready += 1
        logger.info("kt-hybrid: %s: %s in %.2f s (%d/%d)", layer_name, detail, seconds, self.ready, self.layers)
        if self.ready == self.layers and self.started is not None:
            logger.info(
                "kt-hybrid: CPU experts of all %d layers ready in %.1f s (%d quantized online)",
                self.layers,
                time.perf_counter() - self.started,
                self.quantized,
            )


# The backend's own process state, not the hybrid layers' (hybrid/process_state.py): backends sit
# below the layers and import nothing of them; one count per process, as the log lines say.
PROGRESS = LoadProgress()
