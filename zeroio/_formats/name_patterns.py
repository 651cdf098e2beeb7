"""Regular expressions from checkpoints and ``tp_rules``, matched in bounded time.

Python's ``re`` backtracks: ``(.*.*)*X`` takes exponential time, ``.*.*.*X`` polynomial time of high degree, and
even a harmless pattern is quadratic in a megabyte-long parameter name. A checkpoint's
``universal_checkpoint_info`` and its parameter names are the attacker's, so before a pattern is compiled a
conservative scanner refuses what can blow up (a quantified group holding a quantifier or an alternative,
backreferences, conditionals), and before each match the worst case is estimated from the pattern's quantifiers
and the name's length and refused above :data:`MAX_MATCH_COST`: one match takes at most about 0.1 s, so matching takes time linear
in the number of (pattern, name) pairs, as it would for a genuine checkpoint.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass

__all__ = [
    "MAX_MATCH_COST",
    "MAX_NAME_CHARS",
    "MAX_PATTERN_CHARS",
    "BoundedPattern",
    "PatternError",
    "bounded_match",
    "bounded_pattern",
]

MAX_PATTERN_CHARS = 1000
"""Longest pattern accepted; DeepSpeed's and the presets' are under 100 characters."""
MAX_NAME_CHARS = 4096
"""Longest parameter name matched; real ones are under 200 characters (a 1.8 MB name took minutes)."""
MAX_MATCH_COST = 10**8
"""Estimated backtracking steps one match may take (about 0.1 s of ``re``): ``(len(name) + 1) ** unbounded``
times the choices of bounded quantifiers and alternatives (see :func:`bounded_pattern`)."""

_BOUNDED_REPEAT_LIMIT = 64  # {m,n} with more choices than this counts as unbounded
_REPEAT = re.compile(r"\{(\d*)(,(\d*))?\}")


class PatternError(ValueError):
    """A pattern or name refused before matching (callers turn it into their typed error, naming the file)."""


@dataclass(frozen=True, slots=True)
class BoundedPattern:
    """A compiled pattern and what bounds its backtracking."""

    text: str
    """The pattern as written."""
    regex: re.Pattern[str]
    """The compiled pattern."""
    unbounded: int
    """Number of ``*``, ``+`` and ``{m,}`` quantifiers: each may try every split of the name."""
    choices: int
    """Product of the bounded quantifiers' repeat choices and the alternatives' counts."""

    def cost(self, name: str, *, search: bool) -> int:
        """Worst-case steps of one match (``re.search`` tries every start: one more unbounded factor)."""
        steps: int = (len(name) + 1) ** (self.unbounded + int(search)) * self.choices
        return steps


@dataclass
class _Group:
    quantified_inside: bool = False
    branches: int = 1


def _class_end(text: str, i: int) -> int:
    """Index just past the character class starting at ``text[i] == "["``."""
    j = i + 1
    if text[j : j + 1] == "^":
        j += 1
    if text[j : j + 1] == "]":
        j += 1  # a leading ] is a literal
    while j < len(text) and text[j] != "]":
        j += 2 if text[j] == "\\" else 1
    return j + 1


def _group_prefix(text: str, i: int) -> tuple[int, bool]:
    """Index past ``(`` and its ``?...`` prefix, and whether it opens a group (False for ``(?i)``-style flags)."""
    if text[i + 1 : i + 2] != "?":
        return i + 1, True
    rest = text[i + 2 :]
    if rest[:1] in ("=", "!", ":", ">"):
        return i + 3, True
    if rest[:2] in ("<=", "<!"):
        return i + 4, True
    if rest[:2] == "P<":
        return text.index(">", i) + 1, True
    if rest[:2] == "P=" or rest[:1] == "(":
        raise PatternError("backreferences and conditionals are not accepted")
    j = i + 2
    while j < len(text) and text[j] not in ":)":
        j += 1
    return j + 1, text[j : j + 1] == ":"


def _quantifier(text: str, i: int) -> tuple[int, int | None]:
    """``(index past a quantifier at i, its repeat choices)``; choices None for unbounded, 1 for no quantifier."""
    c = text[i : i + 1]
    if c in ("*", "+"):
        end, choices = i + 1, None
    elif c == "?":
        end, choices = i + 1, 2
    elif c == "{" and (m := _REPEAT.match(text, i)) and (m[1] or m[3]):
        low = int(m[1] or 0)
        high = int(m[3]) if m[3] else (low if m[2] is None else None)
        end = m.end()
        choices = None if high is None or high - low + 1 > _BOUNDED_REPEAT_LIMIT else max(1, high - low + 1)
    else:
        return i, 1
    if text[end : end + 1] in ("?", "+"):  # lazy or possessive: the same choices
        end += 1
    return end, choices


def _scan(text: str) -> tuple[int, int]:
    """``(unbounded quantifiers, bounded choices)`` of a valid pattern; refuses nesting that backtracks badly."""
    stack = [_Group()]
    unbounded, choices = 0, 1
    i = 0
    while i < len(text):
        c = text[i]
        inner: _Group | None = None
        if c == "\\":
            if text[i + 1 : i + 2].isdigit() and text[i + 1] != "0":
                raise PatternError("backreferences are not accepted")
            i += 2
        elif c == "[":
            i = _class_end(text, i)
        elif c == "(":
            i, opens = _group_prefix(text, i)
            if opens:
                stack.append(_Group())
            continue
        elif c == ")":
            inner = stack.pop()
            i += 1
        elif c == "|":
            stack[-1].branches += 1
            i += 1
            continue
        else:
            i += 1
        i, repeat = _quantifier(text, i)
        if inner is not None and repeat != 1 and (inner.quantified_inside or inner.branches > 1):
            raise PatternError("a repeated group may not hold a quantifier or '|' (nested repetition backtracks)")
        if inner is not None:
            stack[-1].quantified_inside |= inner.quantified_inside
            choices *= inner.branches
        if repeat != 1:
            stack[-1].quantified_inside = True
            if repeat is None:
                unbounded += 1
            else:
                choices *= repeat
    return unbounded, choices * stack[0].branches


@functools.lru_cache(maxsize=4096)
def bounded_pattern(text: str) -> BoundedPattern:
    """Compile ``text`` if its matching can be bounded.

    Raises:
        PatternError: too long, not a valid regular expression, or nesting that backtracks exponentially.
    """
    if len(text) > MAX_PATTERN_CHARS:
        raise PatternError(f"it is {len(text)} characters long; patterns may have up to {MAX_PATTERN_CHARS}")
    try:
        regex = re.compile(text)
    except re.error as exc:
        raise PatternError(f"it is not a valid regular expression ({exc})") from None
    unbounded, choices = _scan(text)
    return BoundedPattern(text, regex, unbounded, choices)


def bounded_match(pattern: BoundedPattern, name: str, *, search: bool) -> bool:
    """``re.search`` (or ``re.match``) of ``pattern`` on ``name``, refused when it could take too long.

    Raises:
        PatternError: the name is longer than :data:`MAX_NAME_CHARS`, or this match's estimated cost is over
            :data:`MAX_MATCH_COST`.
    """
    if len(name) > MAX_NAME_CHARS:
        raise PatternError(f"the name is {len(name)} characters long; names may have up to {MAX_NAME_CHARS}")
    if pattern.cost(name, search=search) > MAX_MATCH_COST:
        raise PatternError(
            f"matching it on a {len(name)}-character name could take too long ({pattern.unbounded} unbounded "
            f"repeats, {pattern.choices} bounded choices)"
        )
    return (pattern.regex.search if search else pattern.regex.match)(name) is not None
