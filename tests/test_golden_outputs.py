"""Every file zeroio writes, for every fixture, hashes as it did before the issue-13 restructuring."""

from __future__ import annotations

import json

import golden_outputs
import pytest


@pytest.fixture(scope="module")
def computed() -> dict[str, dict[str, object]]:
    return golden_outputs.compute()


def test_outputs_are_byte_identical_to_the_recorded_ones(computed: dict[str, dict[str, object]]) -> None:
    recorded = json.loads(golden_outputs.GOLDEN.read_text())
    assert sorted(computed) == sorted(recorded)
    differing = [
        f"{fixture}/{case}"
        for fixture, cases in recorded.items()
        for case, hashes in cases.items()
        if computed[fixture].get(case) != hashes
    ]
    assert all(sorted(computed[f]) == sorted(recorded[f]) for f in recorded)
    assert not differing, f"outputs changed: {differing}"
    assert sum(len(cases) for cases in recorded.values()) >= 120  # every fixture x every output kind
