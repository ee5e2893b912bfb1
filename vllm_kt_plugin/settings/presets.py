"""``KT_CONFIG`` presets: ready-made KT_* settings per model, in ``configs/*.yaml``.

A preset sets KT_* values (``settings``), documents the kt-kernel methods that fit the
model (``methods``) and gives the GPU experts per layer for common GPU sizes
(``gpu_experts``); variables set in the environment win. It is checked like the
variables: a mistake is one KTConfigError line naming the preset file, the key, the bad
value and what is allowed. How the GPU size is read: docs/choosing-settings.md."""

from __future__ import annotations

import importlib.resources
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from vllm_kt_plugin.settings.catalogue import GIB, KNOWN_VARIABLES, KT_METHODS, LOGGER_NAME
from vllm_kt_plugin.settings.errors import KTConfigError
from vllm_kt_plugin.settings.model_memory import ModelConfigError, ModelMemory, estimate_model_memory
from vllm_kt_plugin.settings.variables import KTSettings, parse_variable
from vllm_kt_plugin.source_checkout import checkout_path

logger = logging.getLogger(LOGGER_NAME)

PRESET_KEYS = frozenset(
    {"name", "aliases", "description", "models", "settings", "methods", "model_config", "gpu_experts"}
)
PRESET_SETTINGS = KNOWN_VARIABLES - {"KT_CONFIG"}
# Two ways to size the GPU share; the environment's choice replaces the preset's, not joins it.
GPU_COUNT_VARIABLES = ("KT_NUM_GPU_EXPERTS", "KT_GPU_EXPERTS_RATIO")
GPU_SIZE_TOLERANCE = 1.05  # a "80 GB" card reports a little less than 80 GiB usable


@dataclass(frozen=True)
class Preset:
    path: Path
    name: str
    settings: Mapping[str, str]  # KT_* name -> value, as if from the environment
    methods: Mapping[str, str] = field(default_factory=dict)  # kt-kernel method -> what KT_WEIGHT_PATH must hold
    experts_by_gpu_gb: Mapping[int, int] = field(default_factory=dict)  # the gpu_experts table
    memory: ModelMemory | None = None  # from model_config, when given

    def experts_for_gpu(self, gpu_memory_gb: float) -> tuple[int, int] | None:
        """(table GPU size, experts per layer) for a GPU of this size; None without a table."""
        if not self.experts_by_gpu_gb:
            return None
        fitting = [gb for gb in self.experts_by_gpu_gb if gb <= gpu_memory_gb * GPU_SIZE_TOLERANCE]
        if not fitting:
            return (0, 0)
        size = max(fitting)
        return size, self.experts_by_gpu_gb[size]


class _PresetErrors:
    """Builds the one-line errors of one preset file."""

    def __init__(self, path: Path) -> None:
        self.where = f"KT_CONFIG preset {path}"

    def bad(self, key: str, value: object, allowed: str, reason: str = "") -> KTConfigError:
        return KTConfigError(key, value, reason, allowed, where=self.where)


def preset_dir() -> Path:
    """configs/, the one place presets are edited: shipped in the package as the data package
    vllm_kt_plugin.configs (pyproject.toml: package-dir). Code run from a source checkout
    without an editable install imports the checkout's vllm_kt_plugin/, which holds no
    configs/: the presets are then beside it."""
    try:
        return Path(str(importlib.resources.files("vllm_kt_plugin.configs")))
    except ModuleNotFoundError:
        return checkout_path("configs", needed_by="KT_CONFIG")


def preset_files(directory: Path | None = None) -> list[Path]:
    return sorted((directory or preset_dir()).glob("*.yaml"))


def _names_of(path: Path) -> list[str]:
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except (OSError, yaml.YAMLError):
        return [path.stem]
    if not isinstance(data, dict):
        return [path.stem]
    aliases = data.get("aliases") if isinstance(data.get("aliases"), list) else []
    return [str(data.get("name", path.stem)), path.stem, *map(str, aliases)]


def find_preset(value: str, directory: Path | None = None) -> Path:
    """A preset file from KT_CONFIG: a path, or a name (or alias) of a file in configs/."""
    if "/" in value or value.endswith((".yaml", ".yml")):
        path = Path(value).expanduser()
        if not path.is_file():
            raise KTConfigError("KT_CONFIG", value, "no such file")
        return path.resolve()
    wanted = value.lower()
    for path in preset_files(directory):
        if wanted in (n.lower() for n in _names_of(path)):
            return path
    names = ", ".join(p.stem for p in preset_files(directory))
    raise KTConfigError("KT_CONFIG", value, f"no such preset; presets: {names}")


def _read_yaml(path: Path, errors: _PresetErrors) -> dict[str, Any]:
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"line {mark.line + 1}" if mark else "unknown position"
        raise errors.bad("<file>", path.name, "a YAML mapping", f"not valid YAML at {where}") from None
    if not isinstance(data, dict):
        raise errors.bad("<file>", type(data).__name__, "a YAML mapping of preset keys")
    unknown = sorted(set(map(str, data)) - PRESET_KEYS)
    if unknown:
        raise errors.bad(unknown[0], data[unknown[0]], ", ".join(sorted(PRESET_KEYS)), "unknown key")
    return data


def _settings(data: dict[str, Any], errors: _PresetErrors) -> dict[str, str]:
    raw = data.get("settings") or {}
    if not isinstance(raw, dict):
        raise errors.bad("settings", raw, "a mapping of KT_* variables to values")
    settings: dict[str, str] = {}
    for name, value in raw.items():
        if name not in PRESET_SETTINGS:
            raise errors.bad(f"settings.{name}", value, "a KT_* variable other than KT_CONFIG", "unknown variable")
        if isinstance(value, (dict, list)) or value is None:
            raise errors.bad(f"settings.{name}", value, "a single value, as in the environment")
        settings[name] = str(value)
    return settings


def _methods(data: dict[str, Any], settings: Mapping[str, str], errors: _PresetErrors) -> dict[str, str]:
    raw = data.get("methods") or {}
    if not isinstance(raw, dict):
        raise errors.bad("methods", raw, "a mapping of kt-kernel methods to what KT_WEIGHT_PATH holds")
    for method, text in raw.items():
        if str(method).upper() not in KT_METHODS:
            raise errors.bad(f"methods.{method}", method, ", ".join(KT_METHODS), "unknown method")
        if not isinstance(text, str):
            raise errors.bad(f"methods.{method}", text, "a text saying what KT_WEIGHT_PATH must hold")
    method = settings.get("KT_METHOD", "").upper()
    if raw and method and method not in {str(m).upper() for m in raw}:
        raise errors.bad("settings.KT_METHOD", settings["KT_METHOD"], ", ".join(map(str, raw)), "not in methods")
    return {str(m).upper(): t for m, t in raw.items()}


def _memory(data: dict[str, Any], errors: _PresetErrors) -> ModelMemory | None:
    raw = data.get("model_config")
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise errors.bad("model_config", raw, "a mapping of config.json fields")
    try:
        return estimate_model_memory(raw)
    except (ModelConfigError, TypeError, ValueError) as e:
        raise errors.bad("model_config", "...", "the config.json fields of the model", str(e)) from None


def _gpu_experts_table(data: dict[str, Any], memory: ModelMemory | None, errors: _PresetErrors) -> dict[int, int]:
    raw = data.get("gpu_experts") or {}
    if not isinstance(raw, dict):
        raise errors.bad("gpu_experts", raw, "a mapping of GPU size in GB to experts per layer")
    most = memory.num_experts if memory else None
    allowed = f"an integer from 0 to {most}" if most is not None else "an integer >= 0"
    table: dict[int, int] = {}
    for size, count in raw.items():
        if isinstance(size, bool) or not isinstance(size, int) or size <= 0:
            raise errors.bad(f"gpu_experts.{size}", size, "a GPU size in whole GB, > 0")
        if isinstance(count, bool) or not isinstance(count, int) or count < 0 or (most is not None and count > most):
            raise errors.bad(f"gpu_experts.{size}", count, allowed)
        table[size] = count
    return table


def load_preset(path: Path, *, cores: int, numa_nodes: int) -> Preset:
    """Read and check one preset file; its settings go through the same parser as the
    environment, so a bad value fails exactly as the variable would."""
    errors = _PresetErrors(path)
    data = _read_yaml(path, errors)
    settings = _settings(data, errors)
    try:
        KTSettings.from_env(settings, cores=cores, numa_nodes=numa_nodes)
    except KTConfigError as e:
        raise e.within(f"KT_CONFIG preset {path}: in settings") from None
    methods = _methods(data, settings, errors)
    memory = _memory(data, errors)
    table = _gpu_experts_table(data, memory, errors)
    return Preset(path, str(data.get("name", path.stem)), settings, methods, table, memory)


def detect_gpu_memory_gb() -> float | None:
    """Total memory of GPU 0 in GB where vLLM's platform is CUDA (read through NVML by
    vLLM, which does not initialize CUDA in this process); None otherwise."""
    try:
        from vllm.platforms import current_platform  # deferred: presets also serve doctor and tests

        if not current_platform.is_cuda_alike():
            return None
        return current_platform.get_device_total_memory(0) / GIB
    except Exception:  # no GPU, no NVML, or vLLM missing: the table is then not used
        return None


def apply_preset(
    env: Mapping[str, str],
    *,
    cores: int,
    numa_nodes: int,
    detect_gpu_gb: Callable[[], float | None] = detect_gpu_memory_gb,
) -> tuple[dict[str, str], str]:
    """The environment with the KT_CONFIG preset's values under it (env wins), plus
    KT_NUM_GPU_EXPERTS from the preset's table for this GPU when nothing sets it."""
    path = find_preset(env["KT_CONFIG"].strip())
    preset = load_preset(path, cores=cores, numa_nodes=numa_nodes)
    settings = dict(preset.settings)
    if any(env.get(n, "").strip() for n in GPU_COUNT_VARIABLES):  # the env's way of sizing wins whole
        settings = {k: v for k, v in settings.items() if k not in GPU_COUNT_VARIABLES}
    merged = {**settings, **env}
    overridden = sorted(n for n in preset.settings if n in env or (n in GPU_COUNT_VARIABLES and n not in settings))
    table_line = _apply_gpu_table(preset, merged, detect_gpu_gb)
    logger.info(
        "kt-hybrid: KT_CONFIG preset %s (%s): %s%s%s",
        preset.name,
        path,
        " ".join(f"{k}={v}" for k, v in sorted(preset.settings.items())) or "no settings",
        f"; overridden by the environment: {', '.join(overridden)}" if overridden else "",
        f"; {table_line}" if table_line else "",
    )
    return merged, str(path)


def _apply_gpu_table(preset: Preset, merged: dict[str, str], detect_gpu_gb: Callable[[], float | None]) -> str:
    if not preset.experts_by_gpu_gb or merged.get("KT_NUM_GPU_EXPERTS") or merged.get("KT_GPU_EXPERTS_RATIO"):
        return ""
    gpu_gb = parse_variable(merged, "KT_GPU_MEMORY_GB")
    if gpu_gb is None:
        gpu_gb = detect_gpu_gb()
    if gpu_gb is None:
        return "no GPU size known (set KT_GPU_MEMORY_GB), so the GPU table is not used"
    found = preset.experts_for_gpu(gpu_gb)
    assert found is not None
    size, count = found
    merged["KT_NUM_GPU_EXPERTS"] = str(count)
    if size == 0:
        return f"{gpu_gb:.0f} GB GPU is below the smallest table entry -> KT_NUM_GPU_EXPERTS=0"
    return f"{gpu_gb:.0f} GB GPU -> table entry {size} GB -> KT_NUM_GPU_EXPERTS={count}"
