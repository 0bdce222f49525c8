"""Shared fixtures. `--regen-goldens` rewrites tests/goldens/* from the code."""

import os
import tempfile

import pytest

os.environ.setdefault("MESHPLAN_CACHE_DIR", tempfile.mkdtemp(prefix="meshplan-test-cache-"))


def pytest_addoption(parser):
    parser.addoption("--regen-goldens", action="store_true",
                     help="rewrite golden files instead of comparing with them")


@pytest.fixture
def regen(request) -> bool:
    return request.config.getoption("--regen-goldens")
