"""Every test here is `multihost`, and is skipped (with the reason) where hosts cannot be
made: not root, or no network namespaces."""

from __future__ import annotations

import pytest

from tests.multihost.hosts import unavailable


def pytest_collection_modifyitems(config, items):
    reason = None
    checked = False
    for item in items:
        if "tests/multihost/" not in str(item.fspath).replace("\\", "/"):
            continue
        item.add_marker(pytest.mark.multihost)
        if not checked:
            reason, checked = unavailable(), True
        if reason:
            item.add_marker(pytest.mark.skip(reason=reason))
