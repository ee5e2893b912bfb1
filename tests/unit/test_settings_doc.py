"""docs/settings.md is the settings catalogue's: regenerated here and compared."""

from __future__ import annotations

from vllm_kt_plugin.settings.catalogue import VARIABLES
from vllm_kt_tools.support.settings_doc import doc_path, render


def test_the_settings_document_is_generated_from_the_catalogue() -> None:
    assert doc_path().read_text() == render(), "run: python -m vllm_kt_tools.support.settings_doc"


def test_every_variable_has_a_row() -> None:
    rendered = render()
    for variable in VARIABLES:
        assert f"| `{variable.name}` | {variable.default} |" in rendered, variable.name
        assert all(f"`{old}`, still read" in rendered for old in variable.old_names), variable.name
