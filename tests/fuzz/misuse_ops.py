"""The ``misuse`` operation: one bad call from ``tests/fuzz/misuse.py``'s catalogue, which must raise as documented
naming its argument and leave everything ``tests/fuzz/deep_state.py`` observes as it was (the one-manager half of
the twin check in ``tests/fuzz/twin.py``, which also catches a change that shows only in a later step)."""

from __future__ import annotations

import random

from tests.fuzz.deep_state import deep_state, differences, manager_reads
from tests.fuzz.misuse import call_badly, misuses
from tests.fuzz.world import FuzzWorld


class MisuseOperations(FuzzWorld):
    """Bad calls in the middle of the workload."""

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
