"""Which state class keeps a layer group's pages, by life-cycle kind (as vLLM picks a manager per attention spec)."""

from __future__ import annotations

from typing import Final

from .._base.types import PoolGroupIndex
from .._model.layout import StorageLayout
from .._model.life_cycle import FullAttentionLifeCycle, LifeCycle, SsmLifeCycle, WindowedAttentionLifeCycle
from .._pages.page_store import PageStore
from .attention_state import AttentionState, FullAttentionState, WindowedAttentionState
from .group_state import GroupState
from .ssm_state import SsmState

ATTENTION_STATE_CLASSES: Final[dict[type[LifeCycle], type[AttentionState]]] = {
    FullAttentionLifeCycle: FullAttentionState,
    WindowedAttentionLifeCycle: WindowedAttentionState,
}


class GroupStates:
    """A new cache's layer-group states: all of them by layer-group id, and each kind's own list (in id order),
    on which the cache runs that kind's steps."""

    def __init__(
        self,
        life_cycles: list[LifeCycle],
        pool_group_of: list[PoolGroupIndex],
        store: PageStore,
        layout: StorageLayout,
        num_blocks: int,
    ) -> None:
        self.all: list[GroupState] = []
        self.attention: list[AttentionState] = []
        self.ssm: list[SsmState] = []
        for life_cycle in life_cycles:
            pool_group = pool_group_of[life_cycle.id]
            if type(life_cycle) is SsmLifeCycle:
                ssm = SsmState(life_cycle, pool_group, store, layout)
                self.ssm.append(ssm)
                self.all.append(ssm)
            else:
                attention = ATTENTION_STATE_CLASSES[type(life_cycle)](life_cycle, pool_group, store, layout, num_blocks)
                self.attention.append(attention)
                self.all.append(attention)
