"""Slot moves between the hot tier and a cold tier through a ``ColdPageCodec`` (``page_codec.py``).

A hot slot spreads one page over its pool group's pools; a cold slot holds the encoded page in one pool. Offload
gathers the hot rows into one plain page per row, encodes it on the hot tier's side (where the codec's kernels
run: the GPU on the cuda backend) and copies the encoded rows into the cold pool; onboard copies the encoded rows
to the hot side, decodes them and scatters each pool's columns back. Every copy goes through ``copy_rows`` from
or into a staging pool of ``count`` rows, so any pair of tiers (device, pinned, host, disk) works.
"""

from __future__ import annotations

import numpy as np

from ..kernels._checks import IndexVector
from .memory import CudaPoolMemory, HostPoolMemory, PoolMemory, copy_rows, rows_view
from .page_codec import ColdPageCodec


def encode_slots(
    codec: ColdPageCodec,
    layer_group: int,
    cold: PoolMemory,
    cold_rows: IndexVector,
    encoded_bytes: int,
    hot_pools: list[PoolMemory],
    hot_slot_bytes: list[int],
    hot_rows: IndexVector,
) -> None:
    """Write the encoded pages of hot slots ``hot_rows`` into rows ``cold_rows`` of the cold pool."""
    count = len(hot_rows)
    on_device = hot_pools[0].on_device
    staged = np.arange(count, dtype=np.int64)
    plain = _staging(on_device, count * sum(hot_slot_bytes))
    plain_rows = rows_view(plain, sum(hot_slot_bytes), count)
    offset = 0
    for pool, size in zip(hot_pools, hot_slot_bytes):
        part = _staging(on_device, count * size)
        copy_rows(part, staged, pool, hot_rows, size)
        plain_rows[:, offset : offset + size] = rows_view(part, size, count)  # type: ignore[index]
        offset += size
    encoded = _staging(on_device, count * encoded_bytes)
    codec.encode(layer_group, plain_rows, rows_view(encoded, encoded_bytes, count))
    copy_rows(cold, cold_rows, encoded, staged, encoded_bytes)


def decode_slots(
    codec: ColdPageCodec,
    layer_group: int,
    hot_pools: list[PoolMemory],
    hot_slot_bytes: list[int],
    hot_rows: IndexVector,
    cold: PoolMemory,
    cold_rows: IndexVector,
    encoded_bytes: int,
) -> None:
    """Restore into hot slots ``hot_rows`` the pages that rows ``cold_rows`` of the cold pool hold encoded."""
    count = len(hot_rows)
    on_device = hot_pools[0].on_device
    staged = np.arange(count, dtype=np.int64)
    encoded = _staging(on_device, count * encoded_bytes)
    copy_rows(encoded, staged, cold, cold_rows, encoded_bytes)
    plain = _staging(on_device, count * sum(hot_slot_bytes))
    plain_rows = rows_view(plain, sum(hot_slot_bytes), count)
    codec.decode(layer_group, rows_view(encoded, encoded_bytes, count), plain_rows)
    offset = 0
    for pool, size in zip(hot_pools, hot_slot_bytes):
        part = _staging(on_device, count * size)
        rows_view(part, size, count)[:, :] = plain_rows[:, offset : offset + size]  # type: ignore[index]
        copy_rows(pool, hot_rows, part, staged, size)
        offset += size


def check_round_trip(codec: ColdPageCodec, layer_group: int, plain_bytes: int, encoded_bytes: int, on_device: bool) -> None:
    """Encode and decode two pages of random bytes where the codec will run: a codec that raises, writes nothing or
    loses a byte is refused at construction (``ValueError`` naming ``cold_page_codec``) rather than serving wrong
    pages later. Costs two pages per layer group, once."""
    count = 2
    staged = np.arange(count, dtype=np.int64)
    source = HostPoolMemory(count * plain_bytes)
    source.host_array()[:] = np.random.default_rng(layer_group).integers(0, 256, count * plain_bytes, dtype=np.uint8)
    inverse = HostPoolMemory(count * plain_bytes)
    inverse.host_array()[:] = ~source.host_array()  # what a decode that writes nothing leaves
    plain = _staging(on_device, count * plain_bytes)
    copy_rows(plain, staged, source, staged, plain_bytes)
    decoded = _staging(on_device, count * plain_bytes)
    copy_rows(decoded, staged, inverse, staged, plain_bytes)
    encoded = _staging(on_device, count * encoded_bytes)
    try:
        codec.encode(layer_group, rows_view(plain, plain_bytes, count), rows_view(encoded, encoded_bytes, count))
        codec.decode(layer_group, rows_view(encoded, encoded_bytes, count), rows_view(decoded, plain_bytes, count))
    except Exception as error:  # noqa: BLE001 - the user's codec may raise anything
        raise ValueError(
            f"cold_page_codec failed to encode and decode a page of layer group {layer_group}: "
            f"{type(error).__name__}: {error}"
        ) from error
    back = HostPoolMemory(count * plain_bytes)
    copy_rows(back, staged, decoded, staged, plain_bytes)
    if not np.array_equal(back.host_array(), source.host_array()):
        raise ValueError(
            f"cold_page_codec: decoding the encoded page of layer group {layer_group} does not give back the "
            f"exact bytes (decode(encode(page)) must equal the page)"
        )


def _staging(on_device: bool, nbytes: int) -> PoolMemory:
    return CudaPoolMemory(nbytes) if on_device else HostPoolMemory(nbytes)
