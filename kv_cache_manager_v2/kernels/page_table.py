"""Page-table conversion for a whole batch (``kernels/page_table.cu``): every (layer, role) table in one launch.

``PageIndexConverter`` turns one sequence's base page indices into one buffer's page indices in Python; an engine
needs that for every layer, role and sequence of a batch on every step. Here the inputs of one layer group are
packed as arrays and one launch fills ``out[c, s]`` = ``converters[c](base[s], mode, scratch[s])``, -1 padded:

- ``base_tables`` int32 ``[num_seqs, max_blocks]``: base page index per block ordinal (-1 = no page);
- ``num_blocks`` ``[num_seqs]``: how many leading entries of each row are the sequence's blocks;
- ``scratch_ranges`` ``[num_seqs, 2]``: each sequence's scratch range ``(beg, end)``, ``(0, 0)`` when it has none;
- ``scratch_slots`` ``[num_seqs, max_scratch_slots]``: its scratch slot ids, padded with -1;
- ``params`` ``[num_converters, 6]``: rows of ``converter_params`` (columns ``PARAM_COLUMNS``).

``pack_base_tables`` and ``pack_scratch`` build the per-sequence arrays from Python lists and ``ScratchDesc``s.
"""

from __future__ import annotations

from typing import Final, Sequence, SupportsIndex

import numpy as np
import numpy.typing as npt

from .._model.addressing import PageIndexConverter, ScratchDesc
from .._base.types import PageIndexMode
from .._base.validation import as_int
from .._base.wording import counted
from ._checks import ArrayMeta, IndexVector, as_int32, check_range, index_vector, int_array, require_host
from ._launch import device_array, flat_geometry, kernel, on_stream, upload

PARAM_COLUMNS: Final = (
    "scale",
    "expansion",
    "layer_offset",
    "scratch_pages_per_block",
    "scratch_page_in_block",
    "mode",
)
"""Columns of a converter parameter row (``mode`` is the ``PageIndexMode`` value), as in kernels/page_table.cu."""

_INT32_LIMIT: Final = 2**31


def converter_params(converters: Sequence[PageIndexConverter], index_mode: PageIndexMode) -> npt.NDArray[np.int32]:
    """``[len(converters), 6]`` parameter rows, all in ``index_mode`` (concatenate tables to mix modes)."""
    if not isinstance(index_mode, PageIndexMode):
        raise TypeError(f"index_mode must be a PageIndexMode, got {index_mode!r}")
    rows: list[list[int]] = []
    for converter in converters:
        if not isinstance(converter, PageIndexConverter):
            raise TypeError(f"converters must hold PageIndexConverter, got {type(converter).__name__}")
        rows.append(
            [
                converter.scale,
                converter.expansion,
                converter.layer_offset,
                converter.scratch_pages_per_block,
                converter.scratch_page_in_block,
                index_mode.value,
            ]
        )
    return np.array(rows, dtype=np.int32).reshape(len(rows), len(PARAM_COLUMNS))


def pack_base_tables(tables: Sequence[IndexVector]) -> tuple[npt.NDArray[np.int32], npt.NDArray[np.int32]]:
    """``(base_tables, num_blocks)`` from one base index list per sequence, rows padded with -1."""
    rows = [int_array(table, f"tables[{i}]", 1) for i, table in enumerate(tables)]
    width = max((int(row.shape[0]) for row in rows), default=0)
    packed = np.full((len(rows), width), -1, dtype=np.int64)
    for i, row in enumerate(rows):
        packed[i, : row.shape[0]] = row
    lengths = np.array([row.shape[0] for row in rows], dtype=np.int64)
    return as_int32(packed, "tables"), as_int32(lengths, "num_blocks")


def pack_scratch(descs: Sequence[ScratchDesc | None]) -> tuple[npt.NDArray[np.int32], npt.NDArray[np.int32]]:
    """``(scratch_ranges, scratch_slots)`` from one descriptor per sequence (None or empty: no scratch)."""
    ranges = np.zeros((len(descs), 2), dtype=np.int64)
    live: list[tuple[int, ...]] = []
    for i, desc in enumerate(descs):
        if desc is not None and not isinstance(desc, ScratchDesc):
            raise TypeError(f"descs[{i}] must be a ScratchDesc or None, got {type(desc).__name__}")
        if desc:
            ranges[i] = (desc.range.beg, desc.range.end)
            live.append(desc.slot_ids)
        else:
            live.append(())
    slots = np.full((len(descs), max((len(ids) for ids in live), default=0)), -1, dtype=np.int64)
    for i, ids in enumerate(live):
        slots[i, : len(ids)] = ids
    return as_int32(ranges, "scratch ranges"), as_int32(slots, "scratch slot_ids")


def convert_page_tables_reference(
    base_tables: npt.NDArray[np.integer],
    num_blocks: IndexVector,
    scratch_ranges: npt.NDArray[np.integer],
    scratch_slots: npt.NDArray[np.integer],
    params: npt.NDArray[np.integer],
    out_width: SupportsIndex | None = None,
) -> npt.NDArray[np.int32]:
    """int32 ``[num_converters, num_seqs, out_width]``: row ``(c, s)`` is what ``PageIndexConverter`` ``c`` returns
    for sequence ``s`` (its first ``num_blocks[s]`` base indices and scratch), padded with -1.

    ``out_width`` defaults to ``max_blocks * max(expansion)``. Raises where the Python converter would: scratch with
    a SHARED converter, too few scratch slots, a base index below -1.
    """
    require_host(base_tables, "base_tables")
    bases = int_array(base_tables, "base_tables", 2)
    batch = _Batch(bases, num_blocks, scratch_ranges, scratch_slots, params, out_width)
    visited = np.arange(bases.shape[1])[None, :] < batch.num_blocks[:, None]
    check_range(np.where(visited, bases, 0), "base_tables", -1, _INT32_LIMIT)
    batch.check_fits_int32(int(np.max(bases, initial=-1)))
    num_seqs, max_blocks = int(bases.shape[0]), int(bases.shape[1])
    scale, expansion, offset, ppb, k, mode = (batch.params[:, i][:, None, None] for i in range(len(PARAM_COLUMNS)))
    per_layer = mode == PageIndexMode.PER_LAYER.value
    column = np.arange(batch.out_width, dtype=np.int64)[None, None, :]
    block = column // expansion
    seq = np.arange(num_seqs)[None, :, None]
    inside = block < batch.num_blocks[None, :, None]
    base = bases[seq, np.minimum(block, max(max_blocks - 1, 0))] if max_blocks else np.full(block.shape, -1)
    normal = np.where(base >= 0, base * scale + np.where(per_layer, offset, 0), -1)
    beg = batch.ranges[:, 0][None, :, None]
    in_scratch = per_layer & (beg <= block) & (block < batch.ranges[:, 1][None, :, None])
    t = (block - beg) * ppb + k
    position = t // scale
    max_slots = int(batch.slots.shape[1])
    held = (position >= 0) & (position < max_slots)
    slot = batch.slots[seq, np.clip(position, 0, max(max_slots - 1, 0))] if max_slots else np.full(t.shape, -1)
    scratch = np.where(held & (slot >= 0), slot * scale + t % scale, -1)
    index = np.where(in_scratch, scratch, normal)
    return np.where(inside & (index >= 0), index * expansion + column % expansion, -1).astype(np.int32)


def convert_page_tables_cuda(
    base_tables: object,
    num_blocks: IndexVector,
    scratch_ranges: npt.NDArray[np.integer],
    scratch_slots: npt.NDArray[np.integer],
    params: npt.NDArray[np.integer],
    out_width: SupportsIndex | None = None,
    stream: object | None = None,
) -> object:
    """``convert_page_tables_reference`` with ``base_tables`` a CuPy int32 array; returns a CuPy int32 array.

    Everything but ``base_tables`` is host data and checked on the host; base indices are not (checking them would
    wait for the device): a negative one, or one whose page index does not fit int32, gives -1 entries ("no page"),
    never another page's index.
    """
    bases = device_array(base_tables, "base_tables")
    if bases.dtype != np.int32 or not bases.flags.c_contiguous or len(bases.shape) != 2:
        raise ValueError(f"base_tables must be C-contiguous 2-D int32, got shape {bases.shape} dtype {bases.dtype}")
    batch = _Batch(bases, num_blocks, scratch_ranges, scratch_slots, params, out_width)
    batch.check_fits_int32(-1)  # scratch slots and layer offsets (host data); the kernel would wrap them silently
    num_seqs, max_blocks = int(bases.shape[0]), int(bases.shape[1])
    num_converters = int(batch.params.shape[0])
    import cupy

    with on_stream(stream):
        out = cupy.empty((num_converters, num_seqs, batch.out_width), dtype=cupy.int32)
        total = num_converters * num_seqs * batch.out_width
        if total:
            grid, block = flat_geometry(total)
            kernel("page_table.cu", "convert_page_tables")(
                grid,
                block,
                (
                    out,
                    base_tables,
                    upload(as_int32(batch.num_blocks, "num_blocks")),
                    upload(as_int32(batch.ranges, "scratch_ranges")),
                    upload(as_int32(batch.slots, "scratch_slots")),
                    upload(as_int32(batch.params, "params")),
                    np.int32(num_converters),
                    np.int32(num_seqs),
                    np.int32(max_blocks),
                    np.int32(batch.slots.shape[1]),
                    np.int32(batch.out_width),
                ),
            )
    return out


class _Batch:
    """The host-side inputs of one conversion, checked against each other as the Python converter would."""

    def __init__(
        self,
        bases: ArrayMeta,
        num_blocks: IndexVector,
        scratch_ranges: npt.NDArray[np.integer],
        scratch_slots: npt.NDArray[np.integer],
        params: npt.NDArray[np.integer],
        out_width: SupportsIndex | None,
    ) -> None:
        if len(bases.shape) != 2:
            raise ValueError(f"base_tables must be 2-D [num_seqs, max_blocks], got shape {bases.shape}")
        num_seqs, max_blocks = int(bases.shape[0]), int(bases.shape[1])
        self.num_blocks = index_vector(num_blocks, "num_blocks", num_seqs, 0, max_blocks + 1)
        self.ranges = _table(scratch_ranges, "scratch_ranges", num_seqs, 2)
        self.slots = _table(scratch_slots, "scratch_slots", num_seqs, None)
        check_range(self.slots, "scratch_slots", -1, _INT32_LIMIT)
        self.params = _table(params, "params", None, len(PARAM_COLUMNS))
        for i, (name, low, high) in enumerate(_PARAM_BOUNDS):
            check_range(self.params[:, i], f"params[:, {i}] ({name})", low, high)
        self._check_within_slot()
        expansion = int(np.max(self.params[:, 1], initial=0))
        needed = max_blocks * expansion
        self.out_width = needed if out_width is None else as_int(out_width, "out_width")
        longest = int(np.max(self.num_blocks, initial=0)) * expansion
        if self.out_width < longest:
            raise ValueError(f"out_width {self.out_width} is too small for {counted(longest, 'entry', 'entries')}")
        self._check_scratch()

    def _check_within_slot(self) -> None:
        """``PageIndexConverter``'s own checks on each row: a layer offset or scratch page outside the row's slot
        would give valid slot ids another buffer's pages, or pages past the pool's end."""
        scale, offset, ppb, k = (self.params[:, i] for i in (0, 2, 3, 4))
        for name, values, bound in (
            ("layer_offset", offset, scale),
            ("scratch_pages_per_block", ppb - 1, scale),
            ("scratch_page_in_block", k, ppb),
        ):
            bad = np.flatnonzero(values >= bound)
            if bad.size:
                row = int(bad[0])
                raise ValueError(
                    f"params[{row}] ({name}) puts pages outside the slot: {self.params[row].tolist()} (columns "
                    f"{', '.join(PARAM_COLUMNS)}; layer_offset < scale, 1 <= scratch_pages_per_block <= scale, "
                    "scratch_page_in_block < scratch_pages_per_block)"
                )

    def _check_scratch(self) -> None:
        """Scratch needs PER_LAYER converters and enough slots for every visited scratch block."""
        beg, end = self.ranges[:, 0], self.ranges[:, 1]
        has_scratch = np.flatnonzero(end > beg)
        if not has_scratch.size or not self.params.shape[0]:
            return
        shared = np.flatnonzero(self.params[:, 5] != PageIndexMode.PER_LAYER.value)
        if shared.size:
            raise ValueError(
                f"scratch (sequence {int(has_scratch[0])}) requires index_mode=PageIndexMode.PER_LAYER, "
                f"but converter {int(shared[0])} is SHARED"
            )
        last = np.minimum(end, self.num_blocks) - 1
        visited = last >= np.maximum(beg, 0)
        held = np.argmax(np.concatenate([self.slots, np.full((self.slots.shape[0], 1), -1)], axis=1) < 0, axis=1)
        scale, ppb, k = self.params[:, 0][:, None], self.params[:, 3][:, None], self.params[:, 4][:, None]
        needed = ((last - beg)[None, :] * ppb + k) // scale + 1
        short = np.argwhere(visited[None, :] & (needed > held[None, :]))
        if short.size:
            converter, seq = int(short[0][0]), int(short[0][1])
            raise ValueError(
                f"scratch_slots[{seq}] has {counted(int(held[seq]), 'slot')}, too few for block {int(last[seq])} of range "
                f"[{int(beg[seq])}, {int(end[seq])}) under converter {converter}"
            )

    def check_fits_int32(self, max_base: int) -> None:
        """Converted indices are int32 on the device: the largest one must fit. A slot's indices end at ``slot *
        scale + max(layer_offset, scale - 1)`` (the layer's page, or a scratch page), each expanded."""
        largest_slot = max(max_base, int(np.max(self.slots, initial=-1)))
        scale = int(np.max(self.params[:, 0], initial=1))
        expansion = int(np.max(self.params[:, 1], initial=1))
        offset = max(int(np.max(self.params[:, 2], initial=0)), scale - 1)
        if (max(largest_slot, 0) * scale + offset + 1) * expansion > _INT32_LIMIT:
            raise ValueError(
                f"page indices of slot {largest_slot} x scale {scale} + layer_offset up to {offset}, x expansion "
                f"{expansion}, overflow int32"
            )


_PARAM_BOUNDS: Final = (
    ("scale", 1, _INT32_LIMIT),
    ("expansion", 1, _INT32_LIMIT),
    ("layer_offset", 0, _INT32_LIMIT),
    ("scratch_pages_per_block", 1, _INT32_LIMIT),
    ("scratch_page_in_block", 0, _INT32_LIMIT),
    ("mode", 0, 2),
)


def _table(values: object, name: str, rows: int | None, columns: int | None) -> npt.NDArray[np.int64]:
    """A host 2-D integer table of the given shape (None: any size on that axis)."""
    require_host(values, name)
    table = int_array(values, name, 2)
    if (rows is not None and table.shape[0] != rows) or (columns is not None and table.shape[1] != columns):
        expected = f"[{'*' if rows is None else rows}, {'*' if columns is None else columns}]"
        raise ValueError(f"{name} must have shape {expected}, got {table.shape}")
    return table
