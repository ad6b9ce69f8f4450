"""Token codes for content checks that see the whole prefix: what the simulator and the fuzzer hand the FakeEngine.

The FakeEngine's records depend on a token and its position only, so a page computed for another prompt (or another
reuse scope) whose block holds the same tokens at the same positions passes its check. Written from these codes
instead, each position's record depends on everything before it, as real K/V does.
"""

from __future__ import annotations

import hashlib
from typing import Sequence, final

from .._base.hashing import Token
from .._base.types import Sealed


@final
class ContextualTokens(Sealed):
    """The codes of a token list that only grows: per position, a 63-bit digest of ``context`` (what else shapes the
    KV: the model, the reuse scope) and every token up to and including it. Incremental: each call digests only the
    tokens added since the last."""

    def __init__(self, context: str = "") -> None:
        self._running = hashlib.blake2b(context.encode(), digest_size=8)
        self._codes: list[int] = []

    def of(self, tokens: Sequence[Token]) -> list[int]:
        """The codes of ``tokens``, which must extend the tokens of every earlier call."""
        for token in tokens[len(self._codes) :]:
            if isinstance(token, bytes):
                self._running.update(b"b" + len(token).to_bytes(4, "little") + token)
            else:
                self._running.update(b"i" + str(token).encode() + b";")
            self._codes.append(int.from_bytes(self._running.copy().digest(), "little") >> 1)
        return self._codes[: len(tokens)]


def contextual_tokens(tokens: Sequence[Token], context: str = "") -> list[int]:
    """``ContextualTokens(context).of(tokens)``: the FakeEngine's tokens for content checks that see the prefix."""
    return ContextualTokens(context).of(tokens)
