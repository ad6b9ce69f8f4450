"""A fake inference engine that proves the manager's addressing by content.

For every layer, role, beam and token it writes an 8-byte record derived from (token, position, layer, role,
beam) into the page the manager names — through the public API only: base page indices, page index converters
and page views — and on every step it re-reads every token the model could attend to and compares. A wrong page,
layer, role, offset, or a tier round trip that loses bytes fails a check.

Pages are NumPy views on the cpu backend and CuPy views on cuda, where records are written and read by small
kernels on the cache's stream (``page_words.py``), ordered with the manager's asynchronous page moves.

Page layout (as the kernels see it): a K or V page is ``[tokens_per_page, ...]`` with ``size / tokens_per_block`` bytes per
token; the record sits at the start of the token's row. Token rows must be multiples of 8 bytes.
"""

from __future__ import annotations

from mypy_extensions import mypyc_attr

import hashlib
from typing import Final, Sequence, SupportsIndex, final

import numpy as np
import numpy.typing as npt

from .._base.hashing import Token
from .._manager.manager import KVCache
from .._manager.manager import KVCacheManager
from .._base.types import PageIndexMode, Sealed
from .._base.validation import as_int
from ..config import AttentionLayerConfig
from .page_words import read_records, read_state, write_records, write_state
from .._base.wording import counted

U64 = npt.NDArray[np.uint64]
I64 = npt.NDArray[np.int64]

_MIX_1: Final = np.uint64(0xBF58476D1CE4E5B9)
_MIX_2: Final = np.uint64(0x94D049BB133111EB)
_GOLDEN: Final = np.uint64(0x9E3779B97F4A7C15)


@mypyc_attr(native_class=False)
class ContentError(AssertionError):
    """A page did not hold what the engine wrote there."""


def token_codes(tokens: Sequence[Token]) -> U64:
    """Each token as a 64-bit code (multimodal digests hashed), for record derivation."""
    codes = np.empty(len(tokens), dtype=np.uint64)
    for i, token in enumerate(tokens):
        if isinstance(token, bytes):
            codes[i] = int.from_bytes(hashlib.blake2b(token, digest_size=8).digest(), "little")
        else:
            codes[i] = token & 0xFFFFFFFFFFFFFFFF
    return codes


def records(codes: U64, positions: I64, layer: int, role: int, beam: int) -> U64:
    """SplitMix64 of (token, position, layer, role, beam): distinct inputs give distinct records."""
    salt = np.uint64(((layer & 0xFFFF) << 40) ^ ((role & 0xFF) << 32) ^ ((beam & 0xFF) << 56))
    with np.errstate(over="ignore"):
        x = codes * _GOLDEN + positions.astype(np.uint64) * _MIX_2 + salt
        x ^= x >> np.uint64(30)
        x *= _MIX_1
        x ^= x >> np.uint64(27)
        x *= _MIX_2
        x ^= x >> np.uint64(31)
    return x


class _BufferView:
    """One (layer, role) of an attention layer, as the engine addresses it."""

    def __init__(self, manager: KVCacheManager, layer_id: int, role: str, role_index: int, mode: PageIndexMode) -> None:
        self.layer_id = layer_id
        self.role_index = role_index
        self.layer_group = int(manager.get_layer_group_id(layer_id))
        self.converter = manager.get_page_index_converter(layer_id, role)
        self.mode = mode
        tpb = manager.tokens_per_block
        stride = manager.get_page_stride(layer_id, role)
        self.tokens_per_page = tpb // self.converter.expansion
        token_bytes = stride // self.tokens_per_page
        # A row under 8 bytes (a per-block buffer such as block scales: valid for the manager, whose pages are opaque)
        # has no room for the record; 0 passed ``% 8`` and failed at the first write, in NumPy.
        if token_bytes < 8 or token_bytes % 8 != 0 or stride % 8 != 0:
            raise ValueError(
                f"layer {layer_id} role {role!r}: the FakeEngine needs token rows of a positive multiple of 8 bytes "
                f"(an 8-byte record each), got a {stride}-byte page of {counted(self.tokens_per_page, 'token')}"
            )
        self.words_per_token = token_bytes // 8
        self.manager = manager
        self.role = role

    def pages(self) -> object:
        """The page view (NumPy or CuPy): row = page index (fetched each time: slot counts change with quotas)."""
        return self.manager.get_page_view(self.layer_id, self.role, self.mode)

    def locate(self, cache: KVCache, positions: I64) -> tuple[I64, I64]:
        """(page index, word column) of each position; page index -1 where the block has no page.

        Scratch blocks (PER_LAYER mode) resolve to their scratch slots through the converter.
        """
        base = cache.get_base_page_indices(self.layer_group)
        scratch = cache.get_scratch_desc(self.layer_group) if self.mode == PageIndexMode.PER_LAYER else None
        pages = np.asarray(self.converter(base, self.mode, scratch), dtype=np.int64)
        expansion = self.converter.expansion
        tpp = self.tokens_per_page
        slots = (positions // (tpp * expansion)) * expansion + (positions % (tpp * expansion)) // tpp
        rows = pages[slots] if len(pages) else np.full(len(positions), -1, dtype=np.int64)
        columns = (positions % tpp) * self.words_per_token
        return rows, columns


def ssm_state_words(codes: U64, layer: int, role: int) -> tuple[int, int]:
    """The fake SSM state after a prefix: (token count, running hash of the prefix, layer and role)."""
    digest = hashlib.blake2b(codes.tobytes(), digest_size=8, person=f"{layer}/{role}".encode()[:16])
    return len(codes), int.from_bytes(digest.digest(), "little")


class _StateView:
    """One (layer, role) of an SSM layer: the first two 64-bit words of the cache's live state slot."""

    def __init__(self, manager: KVCacheManager, layer_id: int, role: str, role_index: int) -> None:
        self.layer_id = layer_id
        self.role = role
        self.role_index = role_index
        self.layer_group = int(manager.get_layer_group_id(layer_id))
        self.converter = manager.get_page_index_converter(layer_id, role)
        if manager.get_page_stride(layer_id, role) < 16:
            raise ValueError(f"SSM layer {layer_id} role {role!r} needs at least 16 bytes of state")
        self.manager = manager

    def row(self, cache: KVCache) -> int:
        """The page row of the cache's live state."""
        slot = cache.get_ssm_block_base_index(self.layer_group)
        if slot < 0:
            raise ContentError(f"cache {cache.id} has no live state for SSM layer {self.layer_id}")
        [row] = self.converter([slot], PageIndexMode.PER_LAYER)
        return int(row)

    def pages(self) -> object:
        return self.manager.get_page_view(self.layer_id, self.role, PageIndexMode.PER_LAYER)


@final
class FakeEngine(Sealed):
    """Drives caches step by step and checks every readable token of every attention layer and the live state of
    every SSM layer (each state's first words encode the tokens it has seen). What it needs of the model's buffers
    (else ``ValueError`` naming the layer and role): an attention buffer's token row (``size / tokens_per_block``
    bytes) a multiple of 8 bytes, for the 8-byte record at its start, and an SSM state of at least 16 bytes. Buffers
    may be much smaller than the model's: only the records are checked.

    ``index_mode`` picks how pages are addressed (PER_LAYER by default: it works with scratch too). What it did
    so far: ``tokens_written`` (positions written, every layer at once), ``tokens_checked`` (token records read
    back and compared, one per position per layer buffer) and ``states_checked`` (SSM live states compared).
    """

    def __init__(self, manager: KVCacheManager, index_mode: PageIndexMode = PageIndexMode.PER_LAYER) -> None:
        self.manager = manager
        self.index_mode = index_mode
        self.tokens_per_block: int = manager.tokens_per_block
        self._views: list[_BufferView] = []
        for layer in manager.config.layers:
            if isinstance(layer, AttentionLayerConfig):
                for role_index, buffer in enumerate(layer.buffers):
                    self._views.append(_BufferView(manager, layer.layer_id, buffer.role, role_index, index_mode))
        self._states: list[_StateView] = []
        for layer in manager.config.layers:
            if not isinstance(layer, AttentionLayerConfig):
                for role_index, buffer in enumerate(layer.buffers):
                    self._states.append(_StateView(manager, layer.layer_id, buffer.role, role_index))
        self._by_layer: list[list[_BufferView]] = []
        for view in self._views:
            if not self._by_layer or self._by_layer[-1][0].layer_id != view.layer_id:
                self._by_layer.append([])
            self._by_layer[-1].append(view)
        self.tokens_written: int = 0
        self.tokens_checked: int = 0
        self.states_checked: int = 0

    def step(self, cache: KVCache, tokens: Sequence[Token]) -> None:
        """One forward step: check the history ``[0, history_length)``, then layer by layer write this step's
        tokens ``[history_length, capacity)`` and read them back — as attention would, before the next layer
        reuses the scratch slots.

        ``tokens`` holds the request's tokens by position (at least ``capacity`` of them).
        """
        self.check(cache, tokens)
        begin = cache.history_length
        end = cache.capacity
        for layer_views in self._by_layer:
            self._write(cache, tokens, begin, end, layer_views)
            self._check(cache, tokens, begin, end, layer_views, scratch_written=True)
        self._write_states(cache, tokens, end)
        self.tokens_written += end - begin

    def write(self, cache: KVCache, tokens: Sequence[Token], begin: SupportsIndex, end: SupportsIndex) -> None:
        """Write positions ``[begin, end)`` of every layer (no read-back)."""
        first, last = as_int(begin, "begin"), as_int(end, "end")
        self._write(cache, tokens, first, last, self._views)
        self.tokens_written += max(0, last - first)

    def check(self, cache: KVCache, tokens: Sequence[Token]) -> None:
        """Compare every history token whose block has a page (and require one wherever attention needs it),
        and each SSM layer's live state with the state of the history prefix."""
        self._check(cache, tokens, 0, cache.history_length, self._views)
        self._check_states(cache, tokens)

    def accept_states(self, cache: KVCache, tokens: Sequence[Token]) -> None:
        """Speculative decoding: after the commit of the accepted draft tokens, set each SSM live state back to
        the state after the history (an engine keeps the state after each draft and copies the accepted one into
        the live slot; the manager never rewinds a recurrent state itself)."""
        if not cache.is_active:
            raise ValueError(f"cache {cache.id} must be active to be written")
        self._write_states(cache, tokens, cache.history_length)

    def _write_states(self, cache: KVCache, tokens: Sequence[Token], end: int) -> None:
        if not self._states:
            return
        codes = token_codes(tokens[:end])
        for state in self._states:
            count, digest = ssm_state_words(codes, state.layer_id, state.role_index)
            write_state(state.pages(), state.row(cache), (count, digest), int(cache.cuda_stream))

    def _check_states(self, cache: KVCache, tokens: Sequence[Token]) -> None:
        history = cache.history_length
        if not self._states or history == 0:
            return
        codes = token_codes(tokens[:history])
        for state in self._states:
            count, digest = ssm_state_words(codes, state.layer_id, state.role_index)
            found_count, found_digest = read_state(state.pages(), state.row(cache), int(cache.cuda_stream))
            if found_count != count or found_digest != digest:
                raise ContentError(
                    f"cache {cache.id} SSM layer {state.layer_id} role {state.role!r}: live state is of "
                    f"{found_count} tokens / {found_digest:#x}, expected the state of {count} tokens / {digest:#x}"
                )
            self.states_checked += 1

    def _write(
        self, cache: KVCache, tokens: Sequence[Token], begin: int, end: int, views: list[_BufferView]
    ) -> None:
        if not cache.is_active:
            raise ValueError(f"cache {cache.id} must be active to be written")
        if end > len(tokens):
            raise ValueError(
                f"tokens holds {counted(len(tokens), 'token')}; writing positions [{begin}, {end}) of cache {cache.id} "
                f"needs {end} (a cache that reused the whole prompt has none left to compute: create it without the last)"
            )
        if begin >= end:
            return
        positions = np.arange(begin, end, dtype=np.int64)
        codes = token_codes(tokens[begin:end])
        for view in views:
            rows, columns = view.locate(cache, positions)
            if (rows < 0).any():
                missing = positions[rows < 0]
                raise ContentError(
                    f"cache {cache.id} layer {view.layer_id} role {view.role!r}: no page for positions "
                    f"{missing[:8].tolist()} being written"
                )
            values = records(codes, positions, view.layer_id, view.role_index, 0)
            write_records(view.pages(), rows, columns, values, int(cache.cuda_stream))

    def _check(
        self,
        cache: KVCache,
        tokens: Sequence[Token],
        begin: int,
        end: int,
        views: list[_BufferView],
        scratch_written: bool = False,
    ) -> None:
        """Compare positions ``[begin, end)`` whose block has a page; require one wherever the query at ``end``
        attends (outside scratch blocks, whose data is legitimately discarded after each layer). Rows in scratch
        blocks are compared only where ``scratch_written`` (read back in the layer that wrote them): past that layer
        nothing may rely on them, and a suspended cache resumes with fresh scratch slots."""
        if not cache.is_active:
            raise ValueError(f"cache {cache.id} must be active to be checked")
        if end <= begin:
            return
        positions = np.arange(begin, end, dtype=np.int64)
        codes = token_codes(tokens[begin:end])
        tpb = self.tokens_per_block
        for view in views:
            rows, columns = view.locate(cache, positions)
            window = self.manager.get_layer_window(view.layer_id)
            needed = self._needed(positions, end, window, view.layer_id)
            present = rows >= 0
            scratch = cache.get_scratch_desc(view.layer_group)
            if scratch:
                blocks = positions // tpb
                kept = (blocks < scratch.range.beg) | (blocks >= scratch.range.end)
                needed &= kept
                if not scratch_written:
                    present &= kept
            absent = needed & (rows < 0)
            if absent.any():
                raise ContentError(
                    f"cache {cache.id} layer {view.layer_id} role {view.role!r}: no page for attended positions "
                    f"{positions[absent][:8].tolist()} (up to {end}, blocks of {tpb})"
                )
            got = read_records(view.pages(), rows[present], columns[present], int(cache.cuda_stream))
            expected = records(codes[present], positions[present], view.layer_id, view.role_index, 0)
            wrong = got != expected
            if wrong.any():
                bad = positions[present][wrong]
                raise ContentError(
                    f"cache {cache.id} layer {view.layer_id} role {view.role!r}: wrong content at positions "
                    f"{bad[:8].tolist()} ({int(wrong.sum())} of {int(present.sum())} checked tokens)"
                )
            self.tokens_checked += int(present.sum())

    def _needed(self, positions: I64, history: int, window: tuple[int, int], layer_id: int) -> npt.NDArray[np.bool_]:
        """Positions the next query (at ``history``) attends to: all, or the window plus the sinks."""
        size, sinks = window
        if size <= 0:
            return np.ones(len(positions), dtype=np.bool_)
        return (positions > history - size) | (positions < sinks)
