"""The ``misuse`` operation: one bad call from ``tests/fuzz/misuse.py``'s catalogue, which must raise as documented
naming its argument and leave everything ``tests/fuzz/deep_state.py`` observes as it was (the one-manager half of
the twin check in ``tests/fuzz/twin.py``, which also catches a change that shows only in a later step); and
``probe``: a longest-prefix-match scheduler's ``probe_reuse`` and ``probe_reuse_by_tier`` of a waiting request, which
must leave it all as it was too (the eviction lists included: a probe that filed its match as used would decide what
is evicted)."""

from __future__ import annotations

import random

from tests.fuzz.deep_state import deep_state, differences, manager_reads
from tests.fuzz.limits import SCOPES
from tests.fuzz.misuse import call_badly, misuses
from tests.fuzz.model import token_arg
from tests.fuzz.world import FuzzWorld


class MisuseOperations(FuzzWorld):
    """Bad calls and probes in the middle of the workload."""

    def misuse(self, seed: int) -> None:
        with self._operation("misuse"):
            rng = random.Random(seed)
            misuse = rng.choice(misuses(self, rng))
            caches = [model.cache for model in self.live + self.closed]
            manager_reads(self.manager, self.events.follow)  # drains: ``before`` has nothing pending
            before = deep_state(self.manager, caches, self.events.follow)
            call_badly(misuse)
            changed = differences(before, deep_state(self.manager, caches, self.events.follow))
            assert not changed, f"bad call {misuse.name!r} changed {sorted(changed)}"

    def probe(self, source: int, cut: int, scope: int, as_numpy: int) -> None:
        """A waiting request's probe (a prefix of a shared prompt or of an earlier request, in any scope, as a list
        or a NumPy array), as an LPM scheduler makes for every waiting request every step: nothing changes."""
        with self._operation("probe"):
            sources = self.shared_prefixes + self.recent
            chosen = sources[source % len(sources)]
            tokens = list(chosen[: len(chosen) - cut % (len(chosen) + 1)])
            caches = [model.cache for model in self.live + self.closed]
            manager_reads(self.manager, self.events.follow)  # drains: ``before`` has nothing pending
            before = deep_state(self.manager, caches, self.events.follow)
            reused = self.manager.probe_reuse(SCOPES[scope % len(SCOPES)], token_arg(tokens, bool(as_numpy)))
            assert 0 <= reused <= len(tokens), (reused, len(tokens))
            changed = differences(before, deep_state(self.manager, caches, self.events.follow))
            assert not changed, f"probe_reuse changed {sorted(changed)}"
            split = self.manager.probe_reuse_by_tier(SCOPES[scope % len(SCOPES)], token_arg(tokens, bool(as_numpy)))
            assert split.tokens == reused and sum(split.tokens_by_level) == reused, (split, reused)
            changed = differences(before, deep_state(self.manager, caches, self.events.follow))
            assert not changed, f"probe_reuse_by_tier changed {sorted(changed)}"
