"""Counts in the sentences the manager writes (refusals, warnings): one helper, so "1 SSM live state" and
"2 SSM live states" read right wherever a count is followed by its noun."""

from __future__ import annotations


def counted(count: int, noun: str, plural: str = "") -> str:
    """``count`` and ``noun``, plural unless one: "1 GPU page", "3 GPU pages"; ``plural`` where adding "s" is not
    the plural ("1 cache's", "2 caches'")."""
    if count == 1:
        return f"{count} {noun}"
    return f"{count} {plural or noun + 's'}"


def is_are(count: int) -> str:
    """The verb after "``count`` of the pages": "is" for one, "are" otherwise."""
    return "is" if count == 1 else "are"
