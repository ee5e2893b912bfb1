"""Every test in this folder starts a real vLLM engine: it is marked ``engine`` here, so
``-m "not engine"`` selects exactly the fast tests (tests/unit/) and a new engine test
cannot forget its marker. Tests that start no engine belong in tests/unit/."""

from __future__ import annotations

from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if HERE in Path(item.path).resolve().parents:
            item.add_marker(pytest.mark.engine)
