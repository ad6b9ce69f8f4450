"""Flags that act on one kind of layer only, refused on a model without that kind: there they did nothing,
without a word (``simulate --preset llama --ssm-interval 64``, ``generate --model smollm2 --scratch``). One rule
for both commands, which name their flags and models in their own words."""

from __future__ import annotations

from typing import Collection, Final, Sequence

from .parsing import usage_error

SSM_LAYERS: Final = "SSM layers"
WINDOW_LAYERS: Final = "sliding-window layers"


def refuse_without_layers(model: str, given: Sequence[tuple[str, str]], kinds: Collection[str]) -> None:
    """A usage error naming ``model`` and every flag of ``given`` (its words as typed, the kind of layer it acts on)
    whose kind is not in ``kinds``, the model's layer kinds; nothing when each has its layers."""
    missing: dict[str, list[str]] = {}
    for words, kind in given:
        if kind not in kinds:
            missing.setdefault(kind, []).append(words)
    if missing:
        clauses = " and ".join(f"no {kind} for {', '.join(flags)}" for kind, flags in missing.items())
        count = sum(len(flags) for flags in missing.values())
        usage_error(f"{model} has {clauses} to act on: drop {'it' if count == 1 else 'them'}")
