"""Shared pytest set-up: Hub client isolation and the fixture folder."""

from __future__ import annotations

import os
import tempfile

# The Hub client reads these at import time; keep tests away from real tokens, caches and progress bars.
os.environ.setdefault("HF_HOME", tempfile.mkdtemp(prefix="zeroio-hf-home-"))
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
os.environ.pop("HF_TOKEN", None)

import pytest
from fixture_data import FIXTURES


@pytest.fixture
def fixtures_dir():
    """The folder of genuine DeepSpeed fixtures."""
    return FIXTURES
