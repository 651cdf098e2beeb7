"""docs/environment.md lists every ``ZEROIO_*`` setting the package reads, and a value zeroio cannot read is
refused naming its variable (not a bare ``int()`` error, not silently ignored)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from zeroio._env import env_byte_count, env_positive_int
from zeroio._write.readers import reader_ranks

ROOT = Path(__file__).resolve().parents[1]


def _settings_in_code() -> set[str]:
    names: set[str] = set()
    for path in (ROOT / "zeroio").rglob("*.py"):
        names.update(re.findall(r"\bZEROIO_[A-Z][A-Z_]*[A-Z]\b", path.read_text(encoding="utf-8")))
    return names


def test_every_setting_the_package_reads_is_documented():
    documented = set(re.findall(r"`(ZEROIO_[A-Z_]+)`", (ROOT / "docs" / "environment.md").read_text("utf-8")))
    missing = _settings_in_code() - documented
    assert not missing, f"add to docs/environment.md: {sorted(missing)}"
    assert "ZEROIO_PROGRESS" in documented and "ZEROIO_READ_AHEAD_BYTES" in documented


@pytest.mark.parametrize("text", ["abc", "1e6", "-5", "16 XB"])
def test_a_byte_count_that_is_no_count_names_its_variable(text):
    with pytest.raises(ValueError, match=r"ZEROIO_STAGING_BYTES=.* is not a byte count"):
        env_byte_count("ZEROIO_STAGING_BYTES", text)


@pytest.mark.parametrize(("text", "nbytes"), [("512KiB", 512 * 1024), ("16MiB", 16 << 20), ("4096", 4096)])
def test_byte_counts_take_the_units_the_docs_give(text, nbytes):
    assert env_byte_count("ZEROIO_READ_BLOCK", text) == nbytes


@pytest.mark.parametrize("text", ["eight", "0", "-2", "1.5"])
def test_a_count_that_is_no_count_names_its_variable(text):
    """ZEROIO_READ_THREADS was read with a bare int(): 'eight' failed without its name, '0' became 1."""
    with pytest.raises(ValueError, match=r"ZEROIO_READ_THREADS=.* is not a positive whole number"):
        env_positive_int("ZEROIO_READ_THREADS", text)
    assert env_positive_int("ZEROIO_READ_THREADS", "3") == 3


@pytest.mark.parametrize("text", ["two", "0", "-1"])
def test_readers_per_host_that_is_no_count_is_refused_by_name(text, monkeypatch):
    """ZEROIO_READERS_PER_HOST=two (or 0) was taken as unset: one reader per host, silently."""
    monkeypatch.setenv("ZEROIO_READERS_PER_HOST", text)
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    with pytest.raises(ValueError, match=r"ZEROIO_READERS_PER_HOST=.* is not a positive whole number"):
        reader_ranks(4, "/ckpt")
    monkeypatch.setenv("ZEROIO_READERS_PER_HOST", "2")
    assert reader_ranks(4, "/ckpt") == (0, 1)
