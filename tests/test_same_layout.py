"""One rule for whether two managers' pages can be copied byte for byte, asked by both paths of a handoff: in one
process (``plan_transfer``) and at the NIXL handshake (``KVSender`` / ``KVReceiver``, here two threads of this
process joined by a pipe, each with its own NIXL agent). For each config field that must agree, a pair of layouts
differing only there is refused by both paths with one text; a pair differing only in what may differ (quotas, a
spelling of one layout) is accepted by both, and the in-process handoff's content arrives intact."""

from __future__ import annotations

import dataclasses
import multiprocessing
import threading

import pytest

from kv_cache_manager_v2 import KVCacheManager
from kv_cache_manager_v2._manager.manager import _KVCache
from kv_cache_manager_v2.config import AttentionLayerConfig, BufferConfig, LayerConfig, SsmLayerConfig
from kv_cache_manager_v2.disagg import KVFormat, KVReceiver, KVSender, KVSlice, execute, plan_transfer
from tests.disagg_sides import Side
from tests.helpers import KIB, MIB, attention, seeded_prompt, ssm
from tests.nixl_helpers import FAKE_FORMAT, require_nixl

BASE: list[LayerConfig] = [attention(0, window=64), attention(1)]


def override(layer_id: int, tokens_per_page: int | None) -> AttentionLayerConfig:
    """Full attention whose K/V pages hold ``tokens_per_page`` tokens each (4 KiB a page)."""
    buffers = [BufferConfig(role, 4 * KIB, tokens_per_block_override=tokens_per_page) for role in ("key", "value")]
    return AttentionLayerConfig(layer_id, buffers)


# receiver's layers and tokens_per_block (the sender has BASE at 32), and the refusal's text.
REFUSED: dict[str, tuple[list[LayerConfig], int, str]] = {
    "tokens_per_block": (BASE, 16, "tokens_per_block is 32 on the sender, 16 on the receiver"),
    "number of layers": (BASE[:1], 32, "number of layers is 2 on the sender, 1 on the receiver"),
    "layer_id": ([BASE[0], attention(2)], 32, "layer at position 1 is layer_id 1 on the sender, layer_id 2 on the receiver"),
    "kind": ([BASE[0], ssm(1)], 32, "layer 1 kind is AttentionLayerConfig on the sender, SsmLayerConfig on the receiver"),
    "sliding_window_size": (
        [attention(0, window=128), BASE[1]], 32, "layer 0 sliding_window_size is 64 on the sender, 128 on the receiver"
    ),
    "num_sink_tokens": ([attention(0, window=64, sinks=4), BASE[1]], 32, "layer 0 num_sink_tokens is 0 on the sender, 4 on"),
    "buffer roles": (
        [BASE[0], AttentionLayerConfig(1, [BufferConfig("key", 4 * KIB), BufferConfig("v", 4 * KIB)])],
        32,
        r"layer 1 buffer roles is \['key', 'value'\] on the sender, \['key', 'v'\] on the receiver",
    ),
    "buffer size": ([BASE[0], attention(1, 2 * KIB)], 32, "layer 1 buffer 'key' size is 4096 on the sender, 2048 on the"),
    "tokens_per_block_override": (
        [BASE[0], override(1, 16)], 32, "layer 1 buffer 'key' tokens per page is 32 on the sender, 16 on the receiver"
    ),
}


def handshake(sender_manager: KVCacheManager, receiver_manager: KVCacheManager) -> tuple[str | None, str | None]:
    """Both ends of a NIXL handshake (the sender on a thread); each side's refusal text, None where it connected."""
    ours, theirs = multiprocessing.Pipe()
    refused: dict[str, str] = {}

    def send_side() -> None:
        try:
            KVSender(sender_manager, ours, kv_format=FAKE_FORMAT, timeout_s=30).close()
        except ValueError as error:
            refused["sender"] = str(error)

    thread = threading.Thread(target=send_side)
    thread.start()
    try:
        KVReceiver(receiver_manager, theirs, kv_format=FAKE_FORMAT, timeout_s=30).close()
    except ValueError as error:
        refused["receiver"] = str(error)
    thread.join()
    ours.close()
    theirs.close()
    return refused.get("sender"), refused.get("receiver")


def active_cache(side: Side, prompt: list[int]) -> _KVCache:
    cache = side.manager.create_kv_cache(None, prompt)
    assert cache.resume() and cache.resize(len(prompt), len(prompt))
    return cache


def close_both(src: Side, src_cache: _KVCache, dst: Side, dst_cache: _KVCache) -> None:
    for side, cache in ((src, src_cache), (dst, dst_cache)):
        cache.close()
        side.manager.check_invariants()
        side.manager.shutdown()


@pytest.mark.parametrize("what", list(REFUSED))
def test_a_field_that_must_agree_is_refused_alike_by_both_paths(what: str) -> None:
    """Before: two comparisons, two texts (``tokens_per_block differs: 32 on the sender, ...`` in one process,
    ``layouts differ: tokens_per_block = 32 ...`` at the handshake), and sinks None vs 0 refused by one only."""
    require_nixl()
    layers, tokens_per_block, message = REFUSED[what]
    src = Side(BASE)
    dst = Side(layers, tokens_per_block=tokens_per_block)
    prompt = seeded_prompt(1, 64)
    src_cache = src.prefill(prompt)
    dst_cache = active_cache(dst, prompt)
    counts = [0] * dst.manager.num_layer_groups
    with pytest.raises(ValueError, match=f"^layouts differ: {message}") as refused:
        plan_transfer(src.manager, src_cache, dst.manager, dst_cache, KVSlice(64), counts)
    assert handshake(src.manager, dst.manager) == (str(refused.value), str(refused.value))
    src.engine.check(src_cache, prompt)  # the refusals changed nothing
    close_both(src, src_cache, dst, dst_cache)


ACCEPTED: dict[str, tuple[list[LayerConfig], int]] = {
    "gpu quota": ([attention(0, window=64), attention(1)], 32 * MIB),
    "no sinks spelt 0": ([attention(0, window=64, sinks=0), attention(1)], 16 * MIB),
    "an override of tokens_per_block": ([attention(0, window=64), override(1, 32)], 16 * MIB),
}


@pytest.mark.parametrize("what", list(ACCEPTED))
def test_what_may_differ_is_accepted_by_both_paths(what: str) -> None:
    """Quotas, and two spellings of one layout (no sinks as None or 0, pages of ``tokens_per_block`` tokens with or
    without an override): the same bytes in the same places. Before: the handshake refused both spellings (it
    compared each layer's repr) while ``plan_transfer`` accepted the sinks and refused the override."""
    require_nixl()
    layers, gpu_quota = ACCEPTED[what]
    sender_layers: list[LayerConfig] = [attention(0, window=64), override(1, None) if "override" in what else attention(1)]
    src = Side(sender_layers)
    dst = Side(layers, gpu_quota=gpu_quota)
    prompt = seeded_prompt(2, 200)
    src_cache = src.prefill(prompt)
    dst_cache, counts = dst.receive(prompt)
    plan = plan_transfer(src.manager, src_cache, dst.manager, dst_cache, KVSlice(200), counts)
    assert plan.total_bytes > 0
    execute(plan)
    dst.decode(dst_cache, prompt)  # every row checked token by token
    assert handshake(src.manager, dst.manager) == (None, None)
    close_both(src, src_cache, dst, dst_cache)


def test_every_layer_config_field_is_in_the_rule() -> None:
    """A field added to a layer or buffer config must be decided on (compared, normalised or allowed to differ) in
    ``same_layout.layout_summary``, or pages of two meanings would pass as one."""
    from kv_cache_manager_v2._handoff.same_layout import BUFFER_FIELDS, LAYER_FIELDS

    assert {field.name for field in dataclasses.fields(AttentionLayerConfig)} == set(LAYER_FIELDS)
    assert {field.name for field in dataclasses.fields(SsmLayerConfig)} <= set(LAYER_FIELDS)
    assert {field.name for field in dataclasses.fields(BufferConfig)} == set(BUFFER_FIELDS)


def test_the_kv_format_is_compared_after_the_layout_in_one_process_as_at_the_handshake() -> None:
    """A pair differing in both layout and ``KVFormat`` is refused for the layout on both paths (the handshake sends
    the layout's entries first). Before: ``plan_transfer`` compared the formats first and named the dtype."""
    src = Side(BASE)
    dst = Side([attention(0, window=128), BASE[1]])
    prompt = seeded_prompt(3, 64)
    src_cache = src.prefill(prompt)
    dst_cache = active_cache(dst, prompt)
    with pytest.raises(ValueError, match="^layouts differ: layer 0 sliding_window_size is 64 on the sender"):
        plan_transfer(
            src.manager, src_cache, dst.manager, dst_cache, KVSlice(64), [0, 0],
            src_format=KVFormat("bfloat16", "m"), dst_format=KVFormat("float16", "m"),
        )
    close_both(src, src_cache, dst, dst_cache)

