"""Bamba served through the manager: attention K/V in pages, the mixers' states in the SSM pools.

Per pass over ``[history_length, capacity)`` of one cache, ``PagedAttention`` maps each attention layer's blocks to
page rows through the public addressing API (base page indices -> ``PageIndexConverter``) and runs the kernels'
NumPy twins (``kv_append``, paged attention). ``SsmSlots`` reads and writes each mixer's state (convolution inputs
and SSM state, fp32) in the cache's live SSM slot.

``HybridEngine.generate`` is one request: ``create_kv_cache`` matches the prompt (less its last token) against the
tree, which for a model with SSM layers stops at the last block carrying a snapshot; ``resume`` copies that snapshot
into the live slot; the engine reads it back (zeros when nothing was reused) and computes the rest in chunks, then
decodes greedily. The manager snapshots the live slot when a commit that ends the computed pass (``capacity``)
lands on a multiple of ``ssm_reuse_interval`` (or on any block end with ``mamba_save_last_snapshot``): the live slot
then holds the state after exactly the committed tokens. A chunk that crosses such a multiple is therefore computed
as two passes cut at the multiple (as vLLM's aligned scheduling does), so snapshots are taken whatever the chunk
size; chunks need not align to the interval. With ``mamba_save_last_snapshot`` the prompt's last full block also
ends a pass, so a follow-up turn of the conversation resumes from the end of the prompt rather than the last
multiple of the interval.

``check_against_dense`` compares a run with the whole-sequence forward of the same tokens: the proof that whatever
was reused (pages, a snapshot, from whichever tier) equals what recomputation gives.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final, Sequence, cast

import numpy as np
import numpy.typing as npt

from .. import KVCache, KVCacheManager, PageIndexMode
from .._base.validation import check_minimums
from ..config import AttentionLayerConfig, BufferConfig, LayerConfig, SsmLayerConfig
from ..kernels._checks import HostRows
from ..kernels.attention import AttentionBatch, AttentionParams, paged_attention_reference
from ..kernels.kv_append import kv_append_reference
from .backend import Array
from .bamba import Bamba, BambaSpec, dense_run
from .mamba2 import MambaState

PER_LAYER = PageIndexMode.PER_LAYER
FP32: Final = np.dtype(np.float32).itemsize
LOGITS_TOLERANCE: Final = 1e-4
"""Largest logit difference ``check_against_dense`` accepts. The paged run and the whole-sequence run do the same
fp32 math split into different passes: measured at most 2.8e-6 on the shipped model (logits up to ~3.3)."""


def hybrid_layers(spec: BambaSpec, tokens_per_block: int) -> list[LayerConfig]:
    """The manager's layers: a key and a value buffer per attention layer, ``ssm_state`` and ``conv_state`` (fp32
    bytes of one state) per mixer layer."""
    row_bytes = spec.num_kv_heads * spec.head_dim * FP32
    mamba = spec.mamba
    layers: list[LayerConfig] = []
    for layer in range(spec.num_layers):
        if layer in spec.attention_layers:
            kv = [BufferConfig(role, tokens_per_block * row_bytes) for role in ("key", "value")]
            layers.append(AttentionLayerConfig(layer, kv))
        else:
            states = [
                BufferConfig("ssm_state", int(np.prod(mamba.ssm_state_shape)) * FP32),
                BufferConfig("conv_state", int(np.prod(mamba.conv_state_shape)) * FP32),
            ]
            layers.append(SsmLayerConfig(layer, states))
    return layers


class SsmSlots:
    """The mixers' states in a cache's live SSM slot, read and written through the public addressing API."""

    def __init__(self, manager: KVCacheManager, spec: BambaSpec) -> None:
        self.manager = manager
        self.spec = spec
        self.group: int = int(manager.get_layer_group_id(spec.ssm_layers[0])) if spec.ssm_layers else -1

    def _view(self, cache: KVCache, layer: int, role: str, shape: tuple[int, ...]) -> Array:
        slot = cache.get_ssm_block_base_index(self.group)
        if slot < 0:
            raise RuntimeError(f"cache {cache.id} has no live SSM slot (is it active?)")
        [row] = self.manager.get_page_index_converter(layer, role)([slot], PER_LAYER)
        pages = cast(npt.NDArray[np.uint8], self.manager.get_page_view(layer, role, PER_LAYER))
        size = int(np.prod(shape))
        view: Array = pages[row, : size * FP32].view(np.float32).reshape(shape)
        return view

    def read(self, cache: KVCache) -> list[MambaState]:
        """Copies of the states in the live slot, one per SSM layer."""
        mamba = self.spec.mamba
        return [
            MambaState(
                self._view(cache, layer, "conv_state", mamba.conv_state_shape).copy(),
                self._view(cache, layer, "ssm_state", mamba.ssm_state_shape).copy(),
            )
            for layer in self.spec.ssm_layers
        ]

    def write(self, cache: KVCache, states: Sequence[MambaState]) -> None:
        """Store ``states`` (one per SSM layer) in the live slot."""
        mamba = self.spec.mamba
        for layer, state in zip(self.spec.ssm_layers, states, strict=True):
            self._view(cache, layer, "conv_state", mamba.conv_state_shape)[...] = state.conv
            self._view(cache, layer, "ssm_state", mamba.ssm_state_shape)[...] = state.ssm


class PagedAttention:
    """Attention whose K/V live only in the manager's pages: one cache's pass at a time (cpu backend)."""

    def __init__(self, manager: KVCacheManager, spec: BambaSpec) -> None:
        self.manager = manager
        self.spec = spec
        self.tokens_per_block: int = manager.tokens_per_block
        self.params: AttentionParams = AttentionParams(
            num_kv_heads=spec.num_kv_heads, tokens_per_block=self.tokens_per_block, element_type="float32"
        )
        self._rows: dict[int, tuple[npt.NDArray[np.int64], npt.NDArray[np.int64], AttentionBatch]] = {}
        self._positions = np.zeros(0, dtype=np.int64)

    def begin(self, cache: KVCache) -> None:
        """Page rows of the pass over ``[history_length, capacity)`` for every attention layer."""
        self._positions = np.arange(cache.history_length, cache.capacity, dtype=np.int64)
        blocks = self._positions // self.tokens_per_block
        query_start = np.array([0, len(self._positions)], dtype=np.int64)
        for layer in self.spec.attention_layers:
            bases = cache.get_base_page_indices(self.manager.get_layer_group_id(layer))
            tables = [
                np.asarray(self.manager.get_page_index_converter(layer, role)(bases, PER_LAYER), dtype=np.int64)
                for role in ("key", "value")
            ]
            if int(np.min(tables[0][blocks], initial=0)) < 0:
                raise RuntimeError(f"layer {layer}: a token of this pass has no page to be written to")
            batch = AttentionBatch(query_start, self._positions, tables[0][None, :], tables[1][None, :])
            self._rows[layer] = (tables[0][blocks], tables[1][blocks], batch)

    def attend(self, layer: int, q: Array, k: Array, v: Array) -> Array:
        """Write the pass's K/V of ``layer`` into its pages, then attend through the page tables."""
        key_rows, value_rows, batch = self._rows[layer]
        key_pages = cast(HostRows, self.manager.get_page_view(layer, "key", PER_LAYER))
        value_pages = cast(HostRows, self.manager.get_page_view(layer, "value", PER_LAYER))
        kv_append_reference(key_pages, key_rows, self._positions, k, self.tokens_per_block)
        kv_append_reference(value_pages, value_rows, self._positions, v, self.tokens_per_block)
        out = paged_attention_reference(q, key_pages, value_pages, batch, self.params)
        return np.asarray(out, dtype=np.float32)


@dataclass
class Generation:
    """One request's run: ``reused`` prompt tokens came from the cache; ``logits`` row ``i`` is position
    ``reused + i`` (every position computed, prompt then decode); ``tokens`` are the greedy new tokens."""

    prompt: list[int]
    reused: int
    logits: npt.NDArray[np.float32]
    tokens: list[int]


class ReuseMismatch(AssertionError):
    """A run's logits or greedy tokens differ from recomputing the same tokens without any cache."""


class HybridEngine:
    """Runs requests of one ``Bamba`` through one manager (built with ``hybrid_layers``), one at a time.

    The mixers' states live only in the cache's live SSM slot: each pass reads them there (zeros at history 0)
    and writes them back before committing, so whatever the manager restored (a snapshot on resume, a state
    handed over by ``disagg``) is what the model continues from.
    """

    def __init__(self, model: Bamba, manager: KVCacheManager) -> None:
        self.model = model
        self.manager = manager
        self.slots: SsmSlots = SsmSlots(manager, model.spec)
        self.attention: PagedAttention = PagedAttention(manager, model.spec)
        self.interval: int = manager.config.ssm_reuse_interval
        self.last_snapshot: bool = manager.config.last_snapshot

    def generate(self, prompt: Sequence[int], new_tokens: int, chunk: int) -> Generation:
        """``admit``, ``prefill`` in passes of at most ``chunk`` tokens, ``decode`` ``new_tokens`` greedy tokens,
        then close the cache (its committed blocks stay for later requests)."""
        check_minimums((("new_tokens", new_tokens, 1), ("chunk", chunk, 1)))  # before the manager sees anything
        cache = self.admit(prompt)
        try:
            reused = cache.num_committed_tokens
            prefilled = self.prefill(cache, prompt, chunk)
            decoded, tokens = self.decode(cache, prompt, int(np.argmax(prefilled[-1])), new_tokens)
        finally:
            cache.close()
        return Generation(list(prompt), reused, np.concatenate([prefilled, decoded]), tokens)

    def admit(self, prompt: Sequence[int]) -> KVCache:
        """An active cache for ``prompt``, holding the longest reusable prefix of all but its last token (whose
        logits are needed)."""
        if not prompt:
            raise ValueError("prompt must hold at least one token")
        vocab = self.model.spec.vocab_size
        outside = [token for token in prompt if not 0 <= int(token) < vocab]
        if outside:
            raise ValueError(f"prompt tokens must be in [0, {vocab}), got {outside[0]}")
        cache = self.manager.create_kv_cache(None, [int(token) for token in prompt[:-1]])
        if not cache.resume():
            cache.close()
            raise RuntimeError("resume refused: the GPU tier is too full for this request")
        return cache

    def prefill(self, cache: KVCache, prompt: Sequence[int], chunk: int) -> npt.NDArray[np.float32]:
        """Compute and commit ``prompt[history_length:]`` in passes of at most ``chunk`` tokens; their logits.
        With ``mamba_save_last_snapshot`` a pass also ends where the prompt's last full block does (TensorRT-LLM's
        behaviour of that flag), so the next turn of a conversation resumes from there."""
        check_minimums((("chunk", chunk, 1),))
        tokens = [int(token) for token in prompt]
        last_block_end = len(tokens) // self.manager.tokens_per_block * self.manager.tokens_per_block
        rows = []
        while cache.history_length < len(tokens):
            end = min(cache.history_length + chunk, len(tokens))
            if self.last_snapshot and cache.history_length < last_block_end < end:
                end = last_block_end  # the prompt's last full block ends a pass: its state is snapshotted
            rows.append(self._compute(cache, tokens, end))
        return np.concatenate(rows)

    def decode(
        self, cache: KVCache, prompt: Sequence[int], first_token: int, new_tokens: int
    ) -> tuple[npt.NDArray[np.float32], list[int]]:
        """Greedy tokens from ``first_token`` (the prompt's last logits' choice) on, ``new_tokens`` in all, and the
        logits of the steps after the first. A prompt received by a handoff (history past what is committed) is
        committed first."""
        check_minimums((("new_tokens", new_tokens, 1),))
        tokens = [int(token) for token in prompt]
        if cache.num_committed_tokens < cache.history_length:
            cache.commit(tokens[cache.num_committed_tokens : cache.history_length])
        generated = [int(first_token)]
        rows = [np.zeros((0, self.model.spec.vocab_size), dtype=np.float32)]
        while len(generated) < new_tokens:
            tokens.append(generated[-1])
            rows.append(self._compute(cache, tokens, len(tokens)))
            generated.append(int(np.argmax(rows[-1][-1])))
        return np.concatenate(rows), generated

    def _compute(self, cache: KVCache, tokens: list[int], end: int) -> npt.NDArray[np.float32]:
        """Compute ``[history_length, end)`` and commit it, in passes cut at the snapshot boundaries."""
        rows = []
        while cache.history_length < end:
            begin = cache.history_length
            stop = end if self.interval <= 0 else min(end, (begin // self.interval + 1) * self.interval)
            if not cache.resize(stop):
                raise RuntimeError(f"cache {cache.id}: no room to grow to {stop} tokens")
            states = self.slots.read(cache) if begin > 0 else self.model.initial_states()
            self.attention.begin(cache)
            ids = np.asarray(tokens[begin:stop], dtype=np.int64)
            positions = np.arange(begin, stop, dtype=np.int64)
            rows.append(self.model.forward(ids, positions, states, self.attention.attend))
            self.slots.write(cache, states)
            cache.commit(tokens[cache.num_committed_tokens : stop])
        return np.concatenate(rows)


def check_against_dense(model: Bamba, run: Generation, tolerance: float = LOGITS_TOLERANCE) -> float:
    """The largest logit difference between ``run`` and the whole-sequence forward of its tokens; raises
    ``ReuseMismatch`` when it exceeds ``tolerance`` or a greedy token differs."""
    sequence = run.prompt + run.tokens[:-1]
    reference = dense_run(model, sequence)[run.reused :]
    if reference.shape != run.logits.shape:
        raise ReuseMismatch(f"logits of {run.logits.shape[0]} positions, expected {reference.shape[0]}")
    difference = np.abs(reference - run.logits).max(axis=-1)
    worst = int(np.argmax(difference))
    if float(difference[worst]) > tolerance:
        raise ReuseMismatch(
            f"logits at position {run.reused + worst} differ by {float(difference[worst]):.3e} "
            f"(tolerance {tolerance:.1e}; {run.reused} tokens reused)"
        )
    expected = [int(token) for token in np.argmax(reference[len(run.prompt) - 1 - run.reused :], axis=-1)]
    if expected != run.tokens:
        raise ReuseMismatch(f"greedy tokens {run.tokens}, without reuse {expected}")
    return float(difference[worst])
