"""The fuzzer's limits: how many caches live at once, the bounds of the ints each operation takes (the Hypothesis
rules and the seeded random driver both draw from [0, bound]) and the fixed choices those ints pick from."""

from __future__ import annotations

from typing import Final

from kv_cache_manager_v2 import ReuseScope

MAX_LIVE_CACHES: Final = 6
# Upper bounds (inclusive) of the ints the operations take; both drivers draw from [0, bound].
INDEX_MAX: Final = 7
SOURCE_MAX: Final = 15
CUT_MAX: Final = 300
SUFFIX_MAX: Final = 40
FLAGS_MAX: Final = 63
AMOUNT_MAX: Final = 48
RESIZE_KINDS: Final = 5
RESIZE_MODES: Final = 3
QUOTA_CHOICES: Final = 6
INVALID_KINDS: Final = 10
COUNT_MAX: Final = 64
BATCH_MAX: Final = 3  # batches of 1 + (size % (BATCH_MAX + 1)) requests, bounded by MAX_LIVE_CACHES
FAULTS: Final = 3  # misbehaving callback: out-of-range priority, an exception, or an interrupt (FuzzInterrupt)
COLLECT_POINT_MAX: Final = 200  # the cycle collector runs at about this many allocations into the next call
FOLLOW_UPS: Final = 4  # the call a dropped handle's finalizer may interrupt: create, batch, quota, a callback
REENTRY_TARGETS: Final = 10  # what a priority callback calls back into (Fuzzer._reentry)
COPY_KINDS: Final = 3  # copy.copy, copy.deepcopy, pickle.dumps
HELD_CALLS: Final = 8  # page-changing calls tried on a held cache (ReentrancyOperations.held_call)
# A capacity no manager can give (a batch request with it must come back None).
ABSURD_CAPACITY: Final = 1 << 40

SCOPES: Final[tuple[ReuseScope | None, ...]] = (
    None,
    ReuseScope(),  # same tree as None
    ReuseScope(lora_id=0),  # differs from None
    ReuseScope(lora_id=1, salt=b"tenant"),
)
# A chat template's turn marker: ``fan_out``'s requests put a stretch of it after the system prompt, so that prompt's
# last block gets many children sharing their first tokens (a ChildGroup splits them where they differ).
TURN_MARKER: Final = (3, 1, 4, 1, 5, 9, 2, 6, 5, 3)
# Quota factors (numerator / 4) of a tier's initial quota: shrink, restore, and grow past the reservation; 0 asks for
# one byte (a GPU tier refuses it, no pool group getting a slot, and a check reads the figures its sentence states).
QUOTA_FACTORS: Final = (0, 1, 2, 3, 4, 4, 6)
MULTIMODAL_OFFSET: Final = 1 << 40
