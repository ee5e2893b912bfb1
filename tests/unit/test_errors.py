"""The one error type: it carries its subject and formats one line."""

from __future__ import annotations

import pytest

from vllm_kt_plugin.settings.errors import UNSET, KTConfigError
from vllm_kt_plugin.settings.loader import load_settings


def test_error_carries_variable_value_reason_and_allowed() -> None:
    with pytest.raises(KTConfigError) as exc:
        load_settings({"KT_CPUINFER": "zero"}, cores=8, numa_nodes=1)
    e = exc.value
    assert (e.variable, e.value, e.reason, e.allowed) == ("KT_CPUINFER", "zero", "not an integer", "a positive integer")
    assert str(e) == "KT_CPUINFER='zero' is invalid (not an integer); allowed: a positive integer."


def test_unset_and_nested_errors() -> None:
    unset = KTConfigError("KT_WEIGHT_PATH", UNSET, "LLAMAFILE reads GGUF files", "a directory of *.gguf")
    assert str(unset) == "KT_WEIGHT_PATH is unset (LLAMAFILE reads GGUF files); allowed: a directory of *.gguf."
    nested = KTConfigError("KT_CPUINFER", "0", "must be >= 1").within("KT_CONFIG preset p.yaml: in settings")
    assert str(nested).startswith("KT_CONFIG preset p.yaml: in settings: KT_CPUINFER='0' is invalid (must be >= 1)")
    assert (nested.variable, nested.value) == ("KT_CPUINFER", "0")
