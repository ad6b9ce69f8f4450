"""SSM snapshot copies (``kernels/ssm_copy.cu``): slot-to-slot copies within one pool, all pairs in one launch.

Used when a commit snapshots a cache's live SSM state into a block's snapshot slot, and when the first resume of a
reusing cache copies that snapshot into the cache's private live slot. ``slots`` is the pool as a table
``[num_slots, slot_bytes]``; call once per pool of the SSM pool group.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from ._checks import ArrayMeta, HostRows, IndexVector, as_int32, check_unique, index_vector, require_host, row_table
from ._launch import device_array, kernel, on_stream, row_geometry, upload


def ssm_snapshot_copy_reference(slots: HostRows, src_slots: IndexVector, dst_slots: IndexVector) -> None:
    """Slot ``dst_slots[i]`` <- slot ``src_slots[i]`` for every ``i``; a slot id of -1 skips the pair.

    Destinations must be distinct and no slot may be both a source and a destination.
    """
    require_host(slots, "slots")
    src_ids, dst_ids = _checked(slots, src_slots, dst_slots)
    keep = (src_ids >= 0) & (dst_ids >= 0)
    slots[dst_ids[keep]] = slots[src_ids[keep]]


def ssm_snapshot_copy_cuda(
    slots: object, src_slots: IndexVector, dst_slots: IndexVector, stream: object | None = None
) -> None:
    """``ssm_snapshot_copy_reference`` on a CuPy table, in one launch; slot ids are host data."""
    table = device_array(slots, "slots")
    src_ids, dst_ids = _checked(table, src_slots, dst_slots)
    count = int(src_ids.shape[0])
    if count == 0:
        return
    slot_bytes = int(table.shape[1])
    grid, block = row_geometry(count, slot_bytes)
    with on_stream(stream):
        kernel("ssm_copy.cu", "ssm_snapshot_copy")(
            grid,
            block,
            (
                slots,
                upload(as_int32(src_ids, "src_slots")),
                upload(as_int32(dst_ids, "dst_slots")),
                np.int64(slot_bytes),
                np.int32(count),
            ),
        )


def _checked(
    slots: ArrayMeta, src_slots: IndexVector, dst_slots: IndexVector
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
    num_slots, _ = row_table(slots, "slots")
    src_ids = index_vector(src_slots, "src_slots", len(src_slots), -1, num_slots)
    dst_ids = index_vector(dst_slots, "dst_slots", len(src_slots), -1, num_slots)
    live = (src_ids >= 0) & (dst_ids >= 0)
    check_unique(dst_ids[live], "dst_slots")
    shared = np.intersect1d(src_ids[live], dst_ids[live])
    if shared.size:
        raise ValueError(f"slot {int(shared[0])} is both a source and a destination (in src_slots and dst_slots)")
    return src_ids, dst_ids
