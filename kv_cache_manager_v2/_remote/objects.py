"""What the remote tier puts in the store: keys by content and layout, and framed objects it can verify.

A key is ``kvm2/<layout digest>/lg<life cycle>/pg<pool group>/<chained block key>``; the layout digest covers
everything that shapes a page's bytes besides the tokens (see ``layout_key_prefixes``: the whole model's layout, as
a layer's bytes depend on the layers before it), so no other layout's object is ever read as ours. An object is a
header (magic, format version, payload size, BLAKE2b of key and payload) followed by the payload: anything else
read back is rejected.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import struct
from typing import TYPE_CHECKING, Final, Sequence

import numpy as np

from .._model.life_cycle import LifeCycle
from .._base.remote_store import HostBuffer

if TYPE_CHECKING:
    from .._model.layout import StorageLayout
    from ..config import LayerConfig

FORMAT_VERSION: Final = 1
MAGIC: Final = b"KVM2"
# magic, format version, reserved, payload bytes, BLAKE2b-128 of (key, payload)
HEADER: Final = struct.Struct("<4sHHQ16s")
DIGEST_BYTES: Final = 16


def layout_key_prefixes(
    namespace: str,
    tensor_parallel_rank: int,
    tokens_per_block: int,
    layers: Sequence[LayerConfig],
    life_cycles: list[LifeCycle],
    layout: StorageLayout,
) -> list[str]:
    """Per life cycle, the key prefix its objects share: a digest of everything that shapes its pages' bytes. That
    is the whole model's layout, not only the life cycle's own layers: a layer's keys and values are computed from
    every layer before it, so a group whose own layers match ours but which follows a layer with another window,
    sink count or state holds other bytes; each layer is described by every field of its config
    (``layer_description``). The tensor-parallel rank too: ranks hold different heads in pages of one
    shape."""
    model: list[object] = []
    for life_cycle in life_cycles:
        members = [layer_description(layer) for layer in layers if layer.layer_id in life_cycle.layer_ids]
        model.append([life_cycle.describe(), members])
    order = [layer.layer_id for layer in layers]
    slot_bytes = [group.pool_slot_bytes for group in layout.pool_groups]
    prefixes: list[str] = []
    for life_cycle in life_cycles:
        pool_group = int(layout.life_cycle_pool_group[life_cycle.id])
        shape = [FORMAT_VERSION, namespace, tensor_parallel_rank, tokens_per_block, order, model, slot_bytes]
        digest = hashlib.sha256(json.dumps(shape).encode()).hexdigest()[:32]
        prefixes.append(f"kvm2/{digest}/lg{life_cycle.id}/pg{pool_group}/")
    return prefixes


def layer_description(layer: LayerConfig) -> list[object]:
    """Every field of a layer's config, its buffers' too, not what the manager derives from them: the manager counts
    sink tokens in whole blocks and groups layers by that, while attention over 4 or 8 sinks gives every later layer
    other inputs. A field added to a layer config is covered here without a change."""
    return [type(layer).__name__, dataclasses.asdict(layer)]


def object_digest(key: str, payload: HostBuffer) -> bytes:
    digest = hashlib.blake2b(digest_size=DIGEST_BYTES)
    digest.update(key.encode())
    digest.update(payload.data)
    return digest.digest()


def frame(key: str, payload: HostBuffer, out: HostBuffer) -> None:
    """Write the object for ``payload`` into ``out`` (header then payload; ``out`` is exactly that long)."""
    out[HEADER.size :] = payload
    out[: HEADER.size] = np.frombuffer(
        HEADER.pack(MAGIC, FORMAT_VERSION, 0, payload.nbytes, object_digest(key, payload)), dtype=np.uint8
    )


def unframe(key: str, data: HostBuffer, length: int) -> HostBuffer | None:
    """The payload of an object ``length`` bytes long read into ``data``, or None unless it is exactly ours."""
    if length != data.nbytes:
        return None
    magic, version, _, size, digest = HEADER.unpack(data[: HEADER.size].tobytes())
    payload = data[HEADER.size :]
    if magic != MAGIC or version != FORMAT_VERSION or size != payload.nbytes:
        return None
    if digest != object_digest(key, payload):
        return None
    return payload
