"""Which CPU backend computes a layer's experts.

The configured backend (KT_BACKEND, kt_kernel by default), where it computes what the
layer's experts do (``CPUExperts.cannot_compute``). Where it cannot (kt-kernel: biases,
a clamped SwiGLU, other activations, router weights on the input) and KT_BACKEND was left
unset, the torch backend, which computes every activation of vLLM's MoE kernels exactly:
one log line per process names the layer kind and the backend. A layer no backend can
compute, or one whose backend the user chose and cannot, stops serve with one line.
"""

from __future__ import annotations

import logging

from vllm_kt_plugin.cpu_backends.base import CheckpointFormat, CPUExperts, ExpertMath
from vllm_kt_plugin.cpu_backends.registry import backend_class
from vllm_kt_plugin.settings.catalogue import LOGGER_NAME
from vllm_kt_plugin.settings.errors import KTConfigError
from vllm_kt_plugin.settings.variables import KTSettings

logger = logging.getLogger(LOGGER_NAME)

FALLBACK = "torch"
_announced: set[tuple[str, ExpertMath]] = set()


def backend_for(
    layer_name: str,
    math: ExpertMath,
    backend: type[CPUExperts],
    settings: KTSettings,
    checkpoint: CheckpointFormat,
) -> type[CPUExperts]:
    """The backend that computes this layer's CPU experts (module docstring)."""
    reason = backend.cannot_compute(math)
    if reason is None:
        return backend
    if "KT_BACKEND" in dict(settings.given):
        raise KTConfigError(
            "KT_BACKEND",
            settings.backend,
            f"it cannot compute the experts of {layer_name}: {reason}",
            f"{FALLBACK} (computes them exactly), or unset (picks {FALLBACK} for such layers)",
        )
    fallback = backend_class(FALLBACK)
    why_not = fallback.cannot_compute(math)
    if why_not is None:
        try:
            fallback.validate(settings, checkpoint)
        except KTConfigError as error:
            why_not = f"{error.variable}={error.value}: {error.reason}"
    if why_not is not None:
        raise KTConfigError(
            "--quantization",
            "kt-hybrid",
            f"no CPU backend computes the experts of {layer_name}: {reason}; and {why_not}",
            "a model whose experts a CPU backend computes (docs/supported_models.md)",
        )
    if (backend.name, math) not in _announced:
        _announced.add((backend.name, math))
        logger.info(
            "kt-hybrid: %s cannot compute the experts of %s and its kind (%s): the %s backend computes them",
            backend.name,
            layer_name,
            ", ".join(math.differences()),
            fallback.name,
        )
    return fallback
