"""``RoomModel`` against an exhaustive search: counting one greedy way through the tiers finds room exactly when
some sequence of eviction moves would (the moves: take a free slot, drop a droppable page, or push a held page to
the tier below, which needs room there in turn; a page of the caller waiting to be onboarded may step down a tier
too and is onboarded from there)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kv_cache_manager_v2._pages.room_model import DROPPABLE, FREED, STILL_HELD, UNCLAIMED, RoomModel

State = tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]
# With the caller's pages not yet on the GPU: their levels in onboarding order, and the first one not onboarded.
Waiting = tuple[tuple[int, ...], int]


def _replace(values: tuple[int, ...], level: int, delta: int) -> tuple[int, ...]:
    return values[:level] + (values[level] + delta,) + values[level + 1 :]


def _takes(state: State, level: int, waiting: Waiting = ((), 0)) -> list[tuple[State, Waiting]]:
    """Every state after one slot at ``level`` is made available, by any move (a waiting page of the caller
    may step down a tier too)."""
    free, droppable, held = state
    results: list[tuple[State, Waiting]] = []
    if free[level] > 0:
        results.append(((_replace(free, level, -1), droppable, held), waiting))
    if droppable[level] > 0:
        results.append(((free, _replace(droppable, level, -1), held), waiting))
    if held[level] > 0:
        for pushed, after in _pushes(state, level + 1, waiting):
            results.append(((pushed[0], pushed[1], _replace(pushed[2], level, -1)), after))
    levels, first = waiting
    if level + 1 < len(free):
        for index in range(first, len(levels)):
            if levels[index] == level:
                moved = (levels[:index] + (level + 1,) + levels[index + 1 :], first)
                results.extend(_takes(state, level + 1, moved))
    return results


def _pushes(state: State, level: int, waiting: Waiting = ((), 0)) -> list[tuple[State, Waiting]]:
    """Every state after a held page from above comes into ``level``."""
    if level >= len(state[0]):
        return []
    return [((free, droppable, _replace(held, level, 1)), after)
            for (free, droppable, held), after in _takes(state, level, waiting)]


def _possible(state: State, waiting: tuple[int, ...], first: int, new_pages: int) -> bool:
    """Whether some choice of moves onboards every waiting page in order (a GPU slot each, then the slot it
    leaves where it is by then), then finds ``new_pages`` GPU slots."""
    if first == len(waiting):
        if new_pages == 0:
            return True
        return any(_possible(after, waiting, first, new_pages - 1) for after, _ in _takes(state, 0))
    for after, (levels, _) in _takes(state, 0, (waiting, first)):
        free = _replace(after[0], levels[first], 1)
        if _possible((free, after[1], after[2]), levels, first + 1, new_pages):
            return True
    return False


counts = st.integers(0, 2)


@settings(max_examples=400, deadline=None)
@given(
    levels=st.integers(1, 3),
    data=st.data(),
)
def test_room_model_finds_room_exactly_when_some_eviction_sequence_does(levels: int, data: st.DataObject) -> None:
    free = data.draw(st.lists(counts, min_size=levels, max_size=levels))
    droppable = data.draw(st.lists(counts, min_size=levels, max_size=levels))
    held = data.draw(st.lists(counts, min_size=levels, max_size=levels))
    onboard = [0] + data.draw(st.lists(st.integers(0, 2), min_size=levels - 1, max_size=levels - 1))
    new_pages = data.draw(st.integers(0, 4))
    waiting = tuple(level for level in range(1, levels) for _ in range(onboard[level]))
    expected = _possible((tuple(free), tuple(droppable), tuple(held)), waiting, 0, new_pages)
    assert RoomModel(list(free), list(droppable), list(held)).obtain(new_pages, onboard) == expected


@settings(max_examples=300, deadline=None)
@given(levels=st.integers(2, 3), data=st.data())
def test_room_model_vacates_exactly_when_some_eviction_sequence_does(levels: int, data: st.DataObject) -> None:
    free = data.draw(st.lists(counts, min_size=levels, max_size=levels))
    droppable = data.draw(st.lists(counts, min_size=levels, max_size=levels))
    held = data.draw(st.lists(counts, min_size=levels, max_size=levels))
    level = data.draw(st.integers(0, levels - 2))
    count = data.draw(st.integers(0, 4))

    def possible(state: State, remaining: int) -> bool:
        if remaining == 0:
            return True
        f, d, h = state
        options: list[State] = []
        if d[level] > 0:
            options.append((f, _replace(d, level, -1), h))
        if h[level] > 0:
            options.extend((p[0], p[1], _replace(p[2], level, -1)) for p, _ in _pushes(state, level + 1))
        return any(possible(option, remaining - 1) for option in options)

    expected = possible((tuple(free), tuple(droppable), tuple(held)), count)
    assert RoomModel(list(free), list(droppable), list(held)).vacate(level, count) == expected


def test_the_callers_waiting_pages_step_down_to_let_pages_above_through() -> None:
    """Issue #35 item 19: GPU full of other held pages, the host full of the caller's own pages, free disk slots.
    Those pages step down to the disk (one of them, with one host slot, is the page on its way up) and come up
    from there; with no free slot anywhere nothing can move."""
    cases = [
        (([0, 0, 2], [0, 0, 0], [8, 0, 0]), [0, 2, 2], True),
        (([0, 0, 1], [0, 0, 0], [8, 0, 0]), [0, 1, 3], True),
        (([0, 0, 0], [0, 0, 0], [6, 0, 0]), [0, 2, 4], False),
    ]
    for (free, droppable, held), onboard, expected in cases:
        waiting = tuple(level for level in range(1, 3) for _ in range(onboard[level]))
        assert _possible((tuple(free), tuple(droppable), tuple(held)), waiting, 0, 0) == expected
        assert RoomModel(list(free), list(droppable), list(held)).obtain(0, onboard) == expected


def test_shared_cold_counts_never_reuse_a_slot_or_page_that_may_be_in_another_pool_group() -> None:
    """Under a cold-page codec a GPU pool group's cold counts are shares over several cold pool groups: a page
    pushed down, a slot an onboarded page frees and a waiting page stepping down may each be in a pool group the
    next page does not go to, so only the pooled model counts them."""
    assert RoomModel([0, 1, 5], [0, 0, 0], [2, 0, 0]).vacate(0, 2)  # the first page pushed down moves on
    assert not RoomModel([0, 1, 5], [0, 0, 0], [2, 0, 0], pooled_below=False).vacate(0, 2)
    assert RoomModel([0, 0, 5], [0, 0, 0], [1, 0, 0]).obtain(0, [0, 1])  # the waiting page steps down for the push
    assert not RoomModel([0, 0, 5], [0, 0, 0], [1, 0, 0], pooled_below=False).obtain(0, [0, 1])


def test_a_copied_source_is_room_for_the_pages_after_it() -> None:
    """A resume's copy-on-write sources are filed as each is copied: one with no other user is room for the next
    copy (or any page after it), one another suspended cache holds may move down, one it does not claim (an
    active cache locks it) is no room at all. A source waits like a page to onboard: where nothing else can
    move, it steps down itself and is copied from there."""
    sources = [(0, DROPPABLE), (0, DROPPABLE)]
    assert RoomModel([1, 0], [0, 0], [0, 0]).obtain(2, None, sources)
    assert RoomModel([1, 0], [0, 0], [0, 0]).obtain(3, None, [(0, DROPPABLE), (0, FREED)])
    assert not RoomModel([1, 0], [0, 0], [0, 0]).obtain(2, None, [(UNCLAIMED, DROPPABLE), (0, DROPPABLE)])
    assert not RoomModel([1, 0], [0, 0], [0, 0]).obtain(2, None, [(0, STILL_HELD), (0, DROPPABLE)])  # host full
    assert RoomModel([1, 1], [0, 0], [0, 0]).obtain(2, None, [(0, STILL_HELD), (0, DROPPABLE)])  # it moves down
    assert RoomModel([0, 1], [0, 0], [0, 0]).obtain(1, None, [(0, DROPPABLE)])  # steps down, copied from the host
    assert not RoomModel([0, 1], [0, 0], [0, 0], pooled_below=False).obtain(1, None, [(0, DROPPABLE)])
    assert not RoomModel([0, 0], [0, 0], [0, 0]).obtain(1, None, [(0, DROPPABLE)])


@settings(max_examples=300, deadline=None)
@given(levels=st.integers(1, 3), pooled=st.booleans(), data=st.data())
def test_movable_is_what_vacate_and_obtain_find(levels: int, pooled: bool, data: st.DataObject) -> None:
    """``movable`` (what storage statistics call evictable) is the most pages ``vacate`` lets leave a level, and on
    the GPU the free slots plus it are the most new pages ``obtain`` finds: no room counted that no move makes."""
    free = data.draw(st.lists(st.integers(0, 3), min_size=levels, max_size=levels))
    droppable = data.draw(st.lists(st.integers(0, 3), min_size=levels, max_size=levels))
    held = data.draw(st.lists(st.integers(0, 3), min_size=levels, max_size=levels))
    level = data.draw(st.integers(0, levels - 1))

    def model() -> RoomModel:
        return RoomModel(list(free), list(droppable), list(held), pooled)

    movable = model().movable(level)
    assert model().vacate(level, movable) and not model().vacate(level, movable + 1)
    if level == 0:
        assert model().obtain(free[0] + movable, None) and not model().obtain(free[0] + movable + 1, None)
