"""End-to-end suites against emulated clouds: every test collected under tests/e2e/ is marked `e2e`,
so `make test` (-m "not e2e") leaves them to `make e2e`."""
import pytest


def pytest_collection_modifyitems(config, items):
    for item in items:
        if "/tests/e2e/" in str(item.fspath):
            item.add_marker(pytest.mark.e2e)
