"""``RoomModel`` against an exhaustive search: counting one greedy way through the tiers finds room exactly when
some sequence of eviction moves would (the moves: take a free slot, drop a droppable page, or push a held page to
the tier below, which needs room there in turn)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kv_cache_manager_v2._room_model import RoomModel

State = tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]


def _replace(values: tuple[int, ...], level: int, delta: int) -> tuple[int, ...]:
    return values[:level] + (values[level] + delta,) + values[level + 1 :]


def _takes(state: State, level: int) -> list[State]:
    """Every state after one slot at ``level`` is made available, by any move."""
    free, droppable, held = state
    results: list[State] = []
    if free[level] > 0:
        results.append((_replace(free, level, -1), droppable, held))
    if droppable[level] > 0:
        results.append((free, _replace(droppable, level, -1), held))
    if held[level] > 0:
        for pushed in _pushes(state, level + 1):
            results.append((pushed[0], pushed[1], _replace(pushed[2], level, -1)))
    return results


def _pushes(state: State, level: int) -> list[State]:
    """Every state after a held page from above comes into ``level``."""
    if level >= len(state[0]):
        return []
    return [(free, droppable, _replace(held, level, 1)) for free, droppable, held in _takes(state, level)]


def _possible(state: State, steps: list[int]) -> bool:
    """Whether some choice of moves serves ``steps`` in order (each: a GPU slot; then, for an onboarded page,
    the slot it leaves at that level)."""
    if not steps:
        return True
    level = steps[0]
    for after in _takes(state, 0):
        free = after[0] if level == 0 else _replace(after[0], level, 1)
        if _possible((free, after[1], after[2]), steps[1:]):
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
    steps = [level for level in range(1, levels) for _ in range(onboard[level])] + [0] * new_pages
    expected = _possible((tuple(free), tuple(droppable), tuple(held)), steps)
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
            options.extend((p[0], p[1], _replace(p[2], level, -1)) for p in _pushes(state, level + 1))
        return any(possible(option, remaining - 1) for option in options)

    expected = possible((tuple(free), tuple(droppable), tuple(held)), count)
    assert RoomModel(list(free), list(droppable), list(held)).vacate(level, count) == expected
