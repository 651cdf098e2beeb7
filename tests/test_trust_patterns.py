"""Patterns recorded in a checkpoint, or given as tp_rules, and parameter names are matched in bounded time (issue
23, item 2). The hostile inputs are the AutoTP fixture with its universal_checkpoint_info or a name edited."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
from fixture_data import FIXTURES
from hostile_folders import tp_huge_name, tp_invalid_pattern, tp_nested_pattern

import zeroio
from zeroio import errors
from zeroio._formats.name_patterns import MAX_MATCH_COST, PatternError, bounded_match, bounded_pattern

TP2 = FIXTURES / "layouts" / "autotp_z1_ws2_tp2_bf16"


def _inspect(root: Path, *args: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    """``zeroio inspect`` in a subprocess: the old code ran for minutes, so the timeout is the regression check."""
    return subprocess.run(
        [sys.executable, "-m", "zeroio", "inspect", str(root), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def test_recorded_exponential_pattern_is_refused_in_seconds(tmp_path: Path) -> None:
    """A recorded pattern '(.*.*)*X' (over 60 s of backtracking per name) is refused before any match."""
    root, path = tp_nested_pattern(tmp_path)
    started = time.monotonic()
    result = _inspect(root)
    assert time.monotonic() - started < 20
    assert result.returncode == 1
    assert result.stderr == (
        f"Error: '{path}': recorded universal_checkpoint_info pattern '(.*.*)*X' on parameter "
        "'model.embed_tokens.weight' is refused: a repeated group may not hold a quantifier or '|' (nested "
        "repetition backtracks). The checkpoint is corrupted or hostile (docs/security.md, 'Recorded patterns').\n"
        "(set ZEROIO_DEBUG=1 for the full traceback)\n"
    )


def test_recorded_invalid_pattern_is_a_format_error(tmp_path: Path) -> None:
    """A recorded pattern '(' raises CheckpointFormatError naming the file, not re.error."""
    root, path = tp_invalid_pattern(tmp_path)
    with pytest.raises(errors.CheckpointFormatError, match="is not a valid regular expression") as excinfo:
        zeroio.open(root)
    assert excinfo.value.path == path
    assert "'(' on parameter 'model.embed_tokens.weight' is refused" in str(excinfo.value)


def test_huge_parameter_name_is_refused_in_seconds(tmp_path: Path) -> None:
    """A 405 KB name of repeated 'layernorm' (quadratic for the megatron preset: minutes) is refused at once."""
    root, path = tp_huge_name(tmp_path, 45_000)
    started = time.monotonic()
    result = _inspect(root, "--tp-rules", "megatron")
    assert time.monotonic() - started < 20, result.stderr
    assert result.returncode == 1
    assert result.stderr.startswith(
        f"Error: '{path}' records a parameter name of 405000 characters ('layernormlayernormlayernormlayernormlaye'"
        "...); zeroio matches names of up to 4096. The checkpoint is corrupted or hostile.\n"
    )


@pytest.mark.parametrize(
    ("pattern", "why"),
    [
        ("(.*.*)*X", "nested repetition"),
        ("(a|aa)+$", "nested repetition"),
        ("(?:x+)*", "nested repetition"),
        (r"(\w+)\1", "backreferences"),
        ("(?P<w>a)(?P=w)", "backreferences"),
        ("(a)(?(1)b|c)", "conditionals"),
        ("(", "not a valid regular expression"),
        ("a" * 1001, "patterns may have up to 1000"),
    ],
)
def test_unbounded_patterns_are_refused(pattern: str, why: str) -> None:
    """Nesting that backtracks exponentially, backreferences, invalid and over-long patterns are refused."""
    with pytest.raises(PatternError, match=why):
        bounded_pattern(pattern)


@pytest.mark.parametrize(
    "pattern",
    [
        r"^model\.layers\.\d+\.self_attn\.o_proj\.weight$",
        r"layer_?norm[^.]*\.(weight|bias)$",
        r"(^|\.)(output_layer|lm_head)\.weight$",
        r"(?i)(?:ab)*c[(*]+",
        r"a{2,5}b{,3}",
    ],
)
def test_plain_patterns_match_as_re_does(pattern: str) -> None:
    """Ordinary patterns (DeepSpeed's, the presets') are accepted and match exactly as re does."""
    compiled = bounded_pattern(pattern)
    for name in ("model.layers.12.self_attn.o_proj.weight", "h.0.post_layernorm.bias", "lm_head.weight", "abcc(*"):
        for search in (False, True):
            expected = (__import__("re").search if search else __import__("re").match)(pattern, name) is not None
            assert bounded_match(compiled, name, search=search) == expected


def test_polynomial_patterns_are_bounded_by_the_name_length() -> None:
    """'.*.*.*X' is fine on short names and refused where its worst case exceeds MAX_MATCH_COST."""
    compiled = bounded_pattern(".*.*.*X")
    assert not bounded_match(compiled, "a" * 100, search=False)
    assert compiled.cost("a" * 1000, search=False) > MAX_MATCH_COST
    started = time.monotonic()
    with pytest.raises(PatternError, match="could take too long"):
        bounded_match(compiled, "a" * 1000, search=False)
    assert time.monotonic() - started < 1


def test_user_rules_are_checked_too() -> None:
    """tp_rules with a nested repetition or an invalid pattern are a ValueError naming the pattern."""
    with pytest.raises(ValueError, match=r"tp_rules pattern '\(a\+\)\+' is refused: a repeated group"):
        zeroio.open(TP2, tp_rules={"(a+)+": 0})
    with pytest.raises(ValueError, match="tp_rules pattern '\\(' is refused: it is not a valid regular expression"):
        zeroio.open(TP2, tp_rules={"(": 0})
