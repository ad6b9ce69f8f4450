"""The wire format byte for byte: golden payloads per event kind, equal to what structs declared like vLLM's
encode (``vllm_event_structs``), and decoded back."""

from __future__ import annotations

import pytest

from tests.events_helpers import require_events_extra

require_events_extra()

import msgspec  # noqa: E402

import tests.vllm_event_structs as vllm  # noqa: E402
from kv_cache_manager_v2.kv_events.adapter import WireBlock  # noqa: E402
from kv_cache_manager_v2.kv_events.index import PrefixIndex  # noqa: E402
from kv_cache_manager_v2.kv_events.listen import describe  # noqa: E402
from kv_cache_manager_v2.kv_events.wire import (  # noqa: E402
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    WireEvent,
    WireFormatError,
    decode_batch,
    encode_batch,
)

# [ts=1.5, [event], data_parallel_rank=0]: fixarray(3), float64 1.5, fixarray(1), the event map, 0.
GOLDEN: dict[str, tuple[WireEvent, vllm.BlockStored | vllm.BlockRemoved | vllm.AllBlocksCleared, str]] = {
    "stored_full_attention": (
        BlockStored((-2717940686317167031,), None, (1, 2, 3, 4), 4, None, "GPU", None, (None,), 1, "full_attention"),
        vllm.BlockStored(
            block_hashes=[-2717940686317167031], parent_block_hash=None, token_ids=[1, 2, 3, 4], block_size=4,
            lora_id=None, medium="GPU", lora_name=None, extra_keys=[None], group_idx=1,
            kv_cache_spec_kind="full_attention",
        ),
        "93cb3ff8000000000000918ba474797065ab426c6f636b53746f726564ac626c6f636b5f68617368657391d3da47ef58977bde49"
        "b1706172656e745f626c6f636b5f68617368c0a9746f6b656e5f6964739401020304aa626c6f636b5f73697a6504a76c6f72615f"
        "6964c0a66d656469756da3475055a96c6f72615f6e616d65c0aa65787472615f6b65797391c0a967726f75705f69647801b26b76"
        "5f63616368655f737065635f6b696e64ae66756c6c5f617474656e74696f6e00",
    ),
    "stored_sliding_window": (
        BlockStored((7, 8), -5, (1, 2, 3, 4), 2, 3, "CPU", "adapter", (("ab12", "salt"), None), 0, "sliding_window", 1024),
        vllm.BlockStored(
            block_hashes=[7, 8], parent_block_hash=-5, token_ids=[1, 2, 3, 4], block_size=2, lora_id=3,
            medium="CPU", lora_name="adapter", extra_keys=[("ab12", "salt"), None], group_idx=0,
            kv_cache_spec_kind="sliding_window", kv_cache_spec_sliding_window=1024,
        ),
        "93cb3ff8000000000000918ca474797065ab426c6f636b53746f726564ac626c6f636b5f686173686573920708b1706172656e74"
        "5f626c6f636b5f68617368fba9746f6b656e5f6964739401020304aa626c6f636b5f73697a6502a76c6f72615f696403a66d6564"
        "69756da3435055a96c6f72615f6e616d65a761646170746572aa65787472615f6b6579739292a461623132a473616c74c0a96772"
        "6f75705f69647800b26b765f63616368655f737065635f6b696e64ae736c6964696e675f77696e646f77bc6b765f6361636865"
        "5f737065635f736c6964696e675f77696e646f77cd040000",
    ),
    "removed": (
        BlockRemoved((2**63 - 1,), "STORAGE", 2),
        vllm.BlockRemoved(block_hashes=[2**63 - 1], medium="STORAGE", group_idx=2),
        "93cb3ff80000000000009184a474797065ac426c6f636b52656d6f766564ac626c6f636b5f68617368657391cf7fffffffffff"
        "ffffa66d656469756da753544f52414745a967726f75705f6964780200",
    ),
    "removed_without_group": (
        BlockRemoved((-(2**63),), None),
        vllm.BlockRemoved(block_hashes=[-(2**63)], medium=None),
        "93cb3ff80000000000009183a474797065ac426c6f636b52656d6f766564ac626c6f636b5f68617368657391d380000000000000"
        "00a66d656469756dc000",
    ),
    "all_blocks_cleared": (
        AllBlocksCleared(),
        vllm.AllBlocksCleared(),
        "93cb3ff80000000000009181a474797065b0416c6c426c6f636b73436c656172656400",
    ),
}


@pytest.mark.parametrize("name", sorted(GOLDEN))
def test_golden_bytes_per_event_kind(name: str) -> None:
    ours, theirs, golden = GOLDEN[name]
    payload = encode_batch(EventBatch(1.5, (ours,), 0))
    assert payload.hex() == golden
    assert msgspec.msgpack.encode(vllm.KVEventBatch(ts=1.5, events=[theirs], data_parallel_rank=0)) == payload
    assert decode_batch(payload) == EventBatch(1.5, (ours,), 0)
    decoded = msgspec.msgpack.decode(payload, type=vllm.KVEventBatch)
    assert decoded.events == [theirs]


def test_batch_is_an_array_with_a_nil_rank_and_events_are_tagged_maps() -> None:
    events: tuple[WireEvent, ...] = (GOLDEN["removed"][0], AllBlocksCleared())
    payload = encode_batch(EventBatch(2.0, events, None))
    assert payload == msgspec.msgpack.encode(
        vllm.KVEventBatch(ts=2.0, events=[GOLDEN["removed"][1], vllm.AllBlocksCleared()])
    )
    raw = msgspec.msgpack.decode(payload)
    assert isinstance(raw, list) and len(raw) == 3 and raw[2] is None
    assert [event["type"] for event in raw[1]] == ["BlockRemoved", "AllBlocksCleared"]
    assert list(raw[1][0]) == ["type", "block_hashes", "medium", "group_idx"]


def test_decoder_takes_vllm_payloads_and_ignores_unknown_fields() -> None:
    payload = msgspec.msgpack.encode(
        [3.0, [{"type": "BlockRemoved", "block_hashes": [5], "medium": "GPU", "future_field": 1}]]
    )
    assert decode_batch(payload) == EventBatch(3.0, (BlockRemoved((5,), "GPU"),), None)


STORED = {"type": "BlockStored", "block_hashes": [1, 2], "parent_block_hash": None, "token_ids": [1, 2, 3, 4],
          "block_size": 2, "lora_id": None, "medium": "GPU", "lora_name": None}


@pytest.mark.parametrize(
    "wire, message",
    [
        ({"ts": 1.0}, "array"),
        ([1.0, [{"type": "BlockEvicted"}], 0], "unknown event type"),
        ([1.0, [["BlockRemoved", [1], "GPU"]], 0], "map tagged"),
        ([1.0, [{"type": "BlockRemoved", "block_hashes": ["x"], "medium": "GPU"}], 0], "block_hashes"),
        (["now", [], 0], "ts"),
        # Each of these reached a router's PrefixIndex and crashed it (IndexError, TypeError: unhashable) or
        # stored blocks of no tokens, before the decoder checked them.
        ([1.0, [STORED | {"extra_keys": [None]}], 0], "extra_keys has 1 entry for 2 block hashes$"),
        ([1.0, [STORED | {"block_hashes": [1], "token_ids": [1, 2], "extra_keys": [None, None]}], 0],
         "extra_keys has 2 entries for 1 block hash$"),
        ([1.0, [STORED | {"extra_keys": [[{"a": 1}], None]}], 0], "extra_keys entry holds strings"),
        ([1.0, [STORED | {"block_size": 0}], 0], "block_size must be >= 1, got 0"),
        ([float("nan"), [], 0], "ts must be a finite number"),
        # A peer's million-item array was quoted whole in the message: now cut to 80 characters.
        ([1.0, [{"type": "BlockRemoved", "block_hashes": list(range(10**6)) + ["x"], "medium": "GPU"}], 0],
         r"block_hashes must be an array of ints or bytes, got \[0, 1, 2, 3, 4, 5, \.\.\.\]$"),
        ([1.0, [STORED | {"parent_block_hash": "ab"}], 0], "parent_block_hash must be an int, bytes or nil"),
    ],
)
def test_decoder_names_what_is_wrong(wire: object, message: str) -> None:
    with pytest.raises(WireFormatError, match=message):
        decode_batch(msgspec.msgpack.encode(wire))
    with pytest.raises(WireFormatError, match="msgpack"):
        decode_batch(b"\xc1")


def test_the_index_survives_two_hashes_of_one_content() -> None:
    """A stream naming one content under two hashes (a lying or buggy publisher) made the second removal raise
    KeyError out of ``PrefixIndex.apply``, half-applied."""
    index = PrefixIndex()
    stored = [BlockStored((h,), None, (1, 2), 2, None, "GPU", None, None, 0, "full_attention") for h in (10, 11)]
    index.apply(EventBatch(1.0, tuple(stored), 0))
    index.apply(EventBatch(2.0, (BlockRemoved((10,), "GPU", 0), BlockRemoved((11,), "GPU", 0)), 0))
    assert index.held_blocks(0) == set() and index.batches == 2
    index.apply(EventBatch(3.0, (stored[0],), 0))
    assert index.reusable_tokens([WireBlock((1, 2), None)]) == 2


def test_vllms_sha256_byte_hashes_decode_and_index_as_the_block_keys_they_are() -> None:
    """vLLM hashes blocks with sha256 by default and sends the digests as bytes (its ``ExternalBlockHash`` is bytes
    or int): a subscriber refusing them skipped every batch of such a publisher."""
    import hashlib

    first, second = (hashlib.sha256(bytes([n])).digest() for n in (1, 2))
    theirs = vllm.BlockStored(
        block_hashes=[first, second], parent_block_hash=None, token_ids=[1, 2, 3, 4], block_size=2, lora_id=None,
        medium="GPU", lora_name=None, group_idx=0, kv_cache_spec_kind="full_attention",
    )
    payload = msgspec.msgpack.encode(vllm.KVEventBatch(ts=1.0, events=[theirs], data_parallel_rank=0))
    batch = decode_batch(payload)
    stored = batch.events[0]
    assert isinstance(stored, BlockStored) and stored.block_hashes == (first, second)
    assert encode_batch(batch) == payload  # and back, byte for byte
    assert f"hashes=[{first.hex()}, {second.hex()}] parent=None" in describe(stored)  # events-listen's line
    index = PrefixIndex()
    index.apply(batch)
    assert index.held_blocks(0) == {first, second}
    assert index.reusable_tokens([WireBlock((1, 2), None), WireBlock((3, 4), None)]) == 4
    removed = vllm.BlockRemoved(block_hashes=[second], medium="GPU", group_idx=0)
    index.apply(decode_batch(msgspec.msgpack.encode(vllm.KVEventBatch(ts=2.0, events=[removed]))))
    assert index.held_blocks(0) == {first}
    assert index.reusable_tokens([WireBlock((1, 2), None), WireBlock((3, 4), None)]) == 2
