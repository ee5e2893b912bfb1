"""The one error type of a bad setting, carrying its subject (as pluggy's errors do).

Every mistake a user can make in a KT_* variable, a preset file, a routing profile or a
vLLM flag kt-hybrid cannot serve becomes one line naming what was set, the bad value,
why it is wrong and what is allowed:

    KT_CPUINFER='zero' is invalid (not an integer); allowed: a positive integer.
    KT_CONFIG preset /p.yaml: gpu_experts.80='x' is invalid; allowed: an integer from 0 to 128.
"""

from __future__ import annotations

from vllm_kt_plugin.settings.catalogue import BY_NAME


class _Unset:
    def __repr__(self) -> str:
        return "UNSET"


UNSET = _Unset()  # the value of a variable that is not set (None can be a file's value)


class KTConfigError(ValueError):
    """A setting is invalid.

    ``variable`` is what was set (a KT_* name, a preset key, a vLLM flag), ``value`` its
    value (``UNSET`` when it is not set), ``reason`` why it is wrong, ``allowed`` what would be right
    (default: the catalogue's text for a KT_* variable), ``where`` where the value was
    read (a preset file, a routing profile), when not the environment.
    """

    def __init__(
        self, variable: str, value: object, reason: str = "", allowed: str | None = None, *, where: str = ""
    ) -> None:
        self.variable = variable
        self.value = value
        self.reason = reason
        self.allowed = allowed if allowed is not None else BY_NAME[variable].allowed
        self.where = where
        super().__init__(self.message)

    @property
    def message(self) -> str:
        prefix = f"{self.where}: " if self.where else ""
        why = f" ({self.reason})" if self.reason else ""
        if self.value is UNSET:
            return f"{prefix}{self.variable} is unset{why}; allowed: {self.allowed}."
        return f"{prefix}{self.variable}={self.value!r} is invalid{why}; allowed: {self.allowed}."

    def within(self, where: str) -> KTConfigError:
        """The same error, found inside ``where`` (e.g. the settings of a preset file)."""
        outer = f"{where}: {self.where}" if self.where else where
        return KTConfigError(self.variable, self.value, self.reason, self.allowed, where=outer)
