"""What a resize, a resume or a batch admission will do, worked out before anything changes (so a refusal or a
failing priority callback leaves no trace)."""

from __future__ import annotations

from .._base.types import DEFAULT_PRIORITY, MAX_BLOCKS_PER_CACHE
from .._pages.page import Page
from .attention_state import AttentionState, Released, entries_by_block

class ResizePlan:
    """A resize worked out before any change: entries to drop, blocks to give pages, slots needed, and the
    priorities of the new pages (the user's callback runs here, so a failing one changes nothing)."""

    def __init__(self, capacity: int, history: int, num_blocks: int, num_pool_groups: int, num_groups: int) -> None:
        self.capacity: int = capacity
        self.history: int = history
        self.num_blocks: int = num_blocks
        self.refused: bool = num_blocks > MAX_BLOCKS_PER_CACHE
        self.scratch: list[tuple[int, int]] = [(0, 0)] * num_groups  # per layer group
        self.scratch_priority: list[int] = [DEFAULT_PRIORITY] * num_groups  # of new scratch slots, per layer group
        self.forgotten: list[Released] = []
        self.wanted: list[tuple[AttentionState, int]] = []  # (group, block ordinal)
        self.priorities: list[int] = []  # of ``wanted``; empty without a priority callback (default priority)
        self.need: list[int] = [0] * num_pool_groups
        # GPU pages per pool group the step lets go of before it takes new ones: room it makes for itself
        # (``plan_forgotten``'s, and the scratch slots the chunk no longer needs).
        self.let_go: list[int] = [0] * num_pool_groups

    def net_need(self) -> list[int]:
        """The new GPU pages per pool group the step needs beyond the room it makes itself (what ``fits`` asks)."""
        return [max(0, need - let_go) for need, let_go in zip(self.need, self.let_go)]

    def kept_pages(self, groups: list[AttentionState]) -> list[Page]:
        """The pages a cache keeps through this step (what its ``Refusal`` counts as its own): its entries outside
        the stale ranges at the new history but those it forgets, and the scratch slots the new chunk keeps."""
        forgotten = {id(page) for _, _, page in self.forgotten}
        kept = [page for page in entries_by_block(groups, self.history) if id(page) not in forgotten]
        for group in groups:
            kept.extend(group.scratch_pages[: group.scratch_slot_count(self.scratch[group.id])])
        return kept

    def shortage(self) -> list[int]:
        """What a refused plan lacked per pool group, for its ``Refusal``: ``need`` (set beyond the GPU tier), or
        the block count where the plan was refused for exceeding ``MAX_BLOCKS_PER_CACHE``."""
        return self.need if any(self.need) else [self.num_blocks] * len(self.need)


    @property
    def itemised(self) -> bool:
        """Whether ``need`` counts exactly the ``wanted`` blocks (not a plan refused by arithmetic alone)."""
        return not self.refused and sum(self.need) == len(self.wanted)

    def narrow(self, capacity: int, history: int, num_blocks: int, shared: range) -> None:
        """Batch sharing (full attention only, so no scratch or stale range): grow only to ``capacity`` and start
        the history at ``history``, leaving out the ``shared`` blocks another request's pages fill; the priorities
        already asked stay with their blocks."""
        kept: list[tuple[AttentionState, int]] = []
        priorities: list[int] = []
        need = [0] * len(self.need)
        for position, (group, ordinal) in enumerate(self.wanted):
            if ordinal < num_blocks and ordinal not in shared:
                kept.append((group, ordinal))
                if self.priorities:
                    priorities.append(self.priorities[position])
                need[group.pool_group] += 1
        self.capacity = capacity
        self.history = history
        self.num_blocks = num_blocks
        self.wanted = kept
        self.priorities = priorities
        self.need = need


class ResumePriorities:
    """Priorities of the pages a resume creates, per layer group (copy-on-write copies, scratch slots, live SSM
    states), asked of the user's callback before anything changes."""

    def __init__(self, cow: list[int], scratch: list[int], ssm: list[int]) -> None:
        self.cow = cow
        self.scratch = scratch
        self.ssm = ssm


class AdmissionPlan:
    """A batch admission of one cache, worked out (callbacks included) before any request of the batch is
    admitted."""

    def __init__(self, growth: ResizePlan, priorities: ResumePriorities) -> None:
        self.growth = growth
        self.priorities = priorities
