"""A router's view of one engine, rebuilt from its KV event stream alone: which blocks each layer group holds,
and how many leading tokens of a prompt the engine could reuse.

Blocks are found by content, as a router without the engine's hash function does: a block is known by
(parent hash, lora id, token ids, extra key), with None as the first block's parent. A prefix of ``k`` blocks is
reusable when every layer group can serve it: full attention holds all ``k`` blocks; a sliding window of ``W``
tokens the blocks of the last ``W`` tokens (at ``L = k * block_size``: from block ``(L + 1 - W) // block_size``);
Mamba the state at block ``k - 1``.
"""

from __future__ import annotations

from typing import Collection, Sequence, SupportsIndex, final

from .adapter import WireBlock
from .wire import (
    FULL_ATTENTION,
    MAMBA,
    SLIDING_WINDOW,
    AllBlocksCleared,
    BlockHash,
    BlockRemoved,
    BlockStored,
    EventBatch,
    ExtraKey,
)
from .._base.types import Sealed
from .._base.validation import as_int, as_optional_int

BlockContent = tuple[BlockHash | None, int | None, tuple[int, ...], ExtraKey]  # parent, lora id, tokens, extra


@final
class PrefixIndex(Sealed):
    """What a router knows of one engine's cache from its event stream: feed it every received batch (``apply``),
    then ask ``reusable_tokens`` of a prompt's full blocks. Partial blocks are not on the wire, so it can answer
    less than the engine's own ``probe_reuse`` (up to one block less per match)."""

    def __init__(self) -> None:
        self.block_size: int = 0
        self.group_kinds: dict[int, tuple[str, int | None]] = {}  # group -> (kind, sliding window)
        self._held: dict[int, dict[BlockHash, set[str]]] = {}  # group -> block hash -> mediums holding it
        self._by_content: dict[BlockContent, BlockHash] = {}
        self._content: dict[BlockHash, BlockContent] = {}
        self._children: dict[BlockHash, int] = {}  # block hash -> known children
        self.batches: int = 0

    def apply(self, batch: EventBatch) -> None:
        """Take one batch's stores and removals (an ``AllBlocksCleared`` forgets everything); apply batches in
        sequence order, as ``EventSubscriber.receive`` hands them out."""
        for event in batch.events:
            if isinstance(event, BlockStored):
                self._stored(event)
            elif isinstance(event, BlockRemoved):
                group = 0 if event.group_idx is None else event.group_idx
                for block_hash in event.block_hashes:
                    self._release(group, block_hash, event.medium or "")
            elif isinstance(event, AllBlocksCleared):
                self._held.clear()
                self._by_content.clear()
                self._content.clear()
                self._children.clear()
        self.batches += 1

    def held_blocks(self, group: SupportsIndex, mediums: Collection[str] | None = None) -> set[BlockHash]:
        """Hashes of the blocks a layer group holds (in any of ``mediums``, all when None)."""
        held = self._held.get(as_int(group, "group"), {})
        return {block for block, where in held.items() if mediums is None or not where.isdisjoint(mediums)}

    def reusable_tokens(
        self, blocks: Sequence[WireBlock], lora_id: SupportsIndex | None = None, mediums: Collection[str] | None = None
    ) -> int:
        """Leading tokens of a prompt (its full blocks, ``adapter.wire_blocks``) that every group can serve."""
        lora = as_optional_int(lora_id, "lora_id")
        chain: list[BlockHash] = []
        parent: BlockHash | None = None
        for block in blocks:
            found = self._by_content.get((parent, lora, block.token_ids, block.extra_key))
            if found is None:
                break
            chain.append(found)
            parent = found
        if not self.group_kinds:
            return 0
        held = {group: self.held_blocks(group, mediums) for group in self.group_kinds}
        for count in range(len(chain), 0, -1):
            if all(self._servable(kind, held[group], chain, count) for group, kind in self.group_kinds.items()):
                return count * self.block_size
        return 0

    def _servable(self, kind: tuple[str, int | None], held: set[BlockHash], chain: list[BlockHash], count: int) -> bool:
        name, window = kind
        if name == MAMBA:
            return chain[count - 1] in held
        first = 0
        if name == SLIDING_WINDOW and window is not None:
            first = max(0, (count * self.block_size + 1 - window) // self.block_size)
        return all(block in held for block in chain[first:count])

    def _stored(self, event: BlockStored) -> None:
        group = 0 if event.group_idx is None else event.group_idx
        self.block_size = event.block_size
        self.group_kinds[group] = (event.kv_cache_spec_kind or FULL_ATTENTION, event.kv_cache_spec_sliding_window)
        held = self._held.setdefault(group, {})
        parent = event.parent_block_hash
        size = event.block_size
        for position, block_hash in enumerate(event.block_hashes):
            extra = event.extra_keys[position] if event.extra_keys is not None else None
            content: BlockContent = (
                parent,
                event.lora_id,
                event.token_ids[position * size : (position + 1) * size],
                extra,
            )
            if block_hash not in self._content:
                self._content[block_hash] = content
                self._by_content[content] = block_hash
                if parent is not None:
                    self._children[parent] = self._children.get(parent, 0) + 1
            held.setdefault(block_hash, set()).add(event.medium or "")
            parent = block_hash

    def _release(self, group: int, block_hash: BlockHash, medium: str) -> None:
        held = self._held.get(group, {})
        where = held.get(block_hash)
        if where is None:
            return
        where.discard(medium)
        if not where:
            del held[block_hash]
        self._forget_if_unused(block_hash)

    def _forget_if_unused(self, block_hash: BlockHash | None) -> None:
        """Drop a block's content once no group holds it and no known block descends from it."""
        while block_hash is not None and self._children.get(block_hash, 0) == 0:
            if any(block_hash in held for held in self._held.values()):
                return
            content = self._content.pop(block_hash, None)
            if content is None:
                return
            if self._by_content.get(content) == block_hash:  # two hashes of one content: the later one owns it
                del self._by_content[content]
            self._children.pop(block_hash, None)
            parent = content[0]
            if parent is not None:  # no count of 0 stays: a parent never stored here would keep it for good
                remaining = self._children[parent] - 1
                if remaining:
                    self._children[parent] = remaining
                else:
                    del self._children[parent]
            block_hash = parent
