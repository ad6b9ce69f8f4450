"""The one rule of whether two managers' pages can be copied byte for byte (a prefill -> decode handoff): both sides
describe their layout as ``(what, value)`` strings (``layout_summary``) and ``check_same_layout_summary`` refuses the
first entry that differs. The NIXL handshake compares the summaries the two processes exchange; ``plan_transfer``
compares its two managers' (``check_same_layout``): one rule, one refusal text."""

from __future__ import annotations

import json

from .._manager.core import internals_of
from .._manager.manager import KVCacheManager
from .._remote.objects import page_format
from ..config import AttentionLayerConfig, LayerConfig
from .._base.wording import counted

# Every field of a layer config the summary describes (``tests/test_same_layout.py`` fails when a config gains one,
# so a new field is decided on, not skipped): the kind, then these, then each buffer's.
LAYER_FIELDS = ("layer_id", "buffers", "sliding_window_size", "num_sink_tokens")
BUFFER_FIELDS = ("role", "size", "tokens_per_block_override")


def layout_summary(manager: KVCacheManager) -> tuple[tuple[str, str], ...]:
    """What both sides of a handoff must agree on, as ``(what, value)`` strings that cross processes, counts before
    what they count: tokens per block; per layer its id, kind, window, sink tokens (none and 0 are one) and each
    buffer's role, size and tokens per page (an override equal to ``tokens_per_block`` is none); the layer groups;
    every pool group's slot bytes; where each buffer's bytes sit in a slot (``page_format``, as the remote tier's keys
    have it: the transfer moves whole slots, and two package versions that place one buffer elsewhere in slots of one
    size would read each other's keys as values). Quotas, tiers and everything else may differ."""
    if not isinstance(manager, KVCacheManager):
        raise TypeError(f"manager must be a KVCacheManager, got {manager!r}")
    internals = internals_of(manager)
    if not internals.layout_summary:  # a summary has entries: empty is not made yet
        internals.layout_summary = _summary(manager)
    return internals.layout_summary


def _summary(manager: KVCacheManager) -> tuple[tuple[str, str], ...]:
    tpb = manager.tokens_per_block
    layers = list(manager.config.layers)
    items = [("tokens_per_block", str(tpb)), ("number of layers", str(len(layers)))]
    for position, layer in enumerate(layers):
        items.extend(_layer_entries(position, layer, tpb))
    items.append(("layer groups", str(manager.layer_grouping)))
    items.append(("number of pool groups", str(manager.num_pool_groups)))
    items.extend(
        (f"pool group {pool_group} slot bytes", str(manager.get_slot_bytes(pool_group)))
        for pool_group in range(manager.num_pool_groups)
    )
    items.append(("page format", json.dumps(page_format(internals_of(manager).services.layout))))
    return tuple(items)


def _layer_entries(position: int, layer: LayerConfig, tpb: int) -> list[tuple[str, str]]:
    name = f"layer {layer.layer_id}"
    items = [(f"layer at position {position}", f"layer_id {layer.layer_id}"), (f"{name} kind", type(layer).__name__)]
    if isinstance(layer, AttentionLayerConfig):
        items.append((f"{name} sliding_window_size", str(layer.sliding_window_size)))
        items.append((f"{name} num_sink_tokens", str(layer.num_sink_tokens or 0)))
    items.append((f"{name} buffer roles", str([buffer.role for buffer in layer.buffers])))
    for buffer in layer.buffers:
        where = f"{name} buffer {buffer.role!r}"
        items.append((f"{where} size", str(buffer.size)))
        items.append((f"{where} tokens per page", str(buffer.tokens_per_block_override or tpb)))
    return items


def check_same_layout_summary(sender: object, receiver: object) -> None:
    """ValueError naming the first entry where the sender's ``layout_summary`` (or ``KVFormat.summary``) differs
    from the receiver's, with each side's value; the same text on both sides of a handshake and in one process."""
    for summary, side in ((sender, "sender"), (receiver, "receiver")):
        if not isinstance(summary, tuple) or not all(isinstance(item, tuple) and len(item) == 2 for item in summary):
            raise ValueError(f"malformed layout summary from the {side}: {summary!r}")
    assert isinstance(sender, tuple) and isinstance(receiver, tuple)
    for (what, value), (other_what, other_value) in zip(sender, receiver):
        if what != other_what:  # a peer of another package version describes its layout otherwise
            raise ValueError(
                f"layouts differ: {what} = {value} on the sender, {other_what} = {other_value} on the receiver"
            )
        if value != other_value:
            raise ValueError(f"layouts differ: {what} is {value} on the sender, {other_value} on the receiver")
    if len(sender) != len(receiver):
        raise ValueError(
            f"layouts differ: {counted(len(sender), 'entry', 'entries')} on the sender, {len(receiver)} on the receiver"
        )


def check_same_layout(
    src_manager: KVCacheManager,
    dst_manager: KVCacheManager,
    src_extra: tuple[tuple[str, str], ...] = (),
    dst_extra: tuple[tuple[str, str], ...] = (),
) -> None:
    """``check_same_layout_summary`` of two managers in this process (``plan_transfer``), the handshake's rule and
    order: ``src_extra`` / ``dst_extra`` (the engines' ``KVFormat.summary``) are compared after the layouts, as the
    handshake appends them."""
    if not isinstance(src_manager, KVCacheManager) or not isinstance(dst_manager, KVCacheManager):
        raise TypeError("src_manager and dst_manager must be KVCacheManager instances")
    sender = layout_summary(src_manager) + src_extra
    receiver = layout_summary(dst_manager) + dst_extra
    if sender != receiver:  # both well formed: made here (the formats' by ``KVFormat.summary``)
        check_same_layout_summary(sender, receiver)
