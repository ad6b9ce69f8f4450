"""Disaggregated serving with a real model: prefill in one process, decode in another, the KV moved over NIXL.

The prefill process (``prefill_process``, started with the ``spawn`` method) loads the model, owns a manager and
a ``KVSender``: per request it prefills the prompt in chunks (its own prefix match first), keeps the greedy first
token, answers with the source descriptors (and that token) and closes the cache once NIXL notified it that the
decode side read the KV. The decode process (``Decoder``) owns another manager (its own quotas) and a
``KVReceiver``: per prompt it runs ``prepare_receiver`` (its own prefix match: a shared system prompt committed by
an earlier request moves no bytes), receives, commits the prompt (so later prompts reuse it here), then decodes
every received sequence in one batch with greedy sampling, one token per step, as ``serving`` does.

The greedy tokens equal the single-process engine's (``serving.Server``): both prefill in chunks of ``chunk``
tokens and decode one token at a time over the same paged path.
"""

from __future__ import annotations

from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Final, Sequence

import numpy as np

from .. import KVCache
from .._model.life_cycle import ceil_div
from ..disagg import KVFormat, KVReceiver, KVSender, TransferError, TransferPlan, prepare_receiver
from .backend import ArrayBackend
from .gguf_model import Model, load_model
from .paged import PagedKV
from .serving import GenerationError, GenerationOptions, paged_kv
from .transformer import Transformer
from .._base.wording import counted

HELLO_WAIT_S: Final = 3600.0
"""How long the prefill process waits for the decode side's hello: the demo's decode side first serves every prompt
with the single-process engine, minutes for Gemma on a loaded CPU (the sender's default, 60 s, gave up before it). A
decode side that exits closes the pipe, which ends the wait at once."""


def kv_format_of(model: Model, backend: ArrayBackend) -> KVFormat:
    """What this engine's pages hold (both processes compare it at the handshake): the backend's K/V dtype (float32
    on the cpu, float16 on cuda), the model, and ``paged``'s rows of one token's heads."""
    spec = model.spec
    page_layout = f"per token: {spec.num_kv_heads} kv heads x {spec.head_dim}"
    return KVFormat(np.dtype(backend.kv_dtype).name, model.name, page_layout)


def prefill(paged: PagedKV, transformer: Transformer, tokens: list[int], chunk: int) -> tuple[KVCache, int]:
    """Compute and commit the prompt in chunks (after the longest cached prefix of all but its last token);
    returns the ACTIVE cache (capacity = history = prompt length) and the greedy first token."""
    manager = paged.manager
    cache = manager.create_kv_cache(None, tokens[:-1])
    try:
        if not cache.resume():
            raise GenerationError(
                f"prompt of {counted(len(tokens), 'token')}: no GPU room to resume on the prefill side"
            )
        first = -1
        while cache.history_length < len(tokens):
            history = cache.history_length
            end = min(len(tokens), history + chunk)
            if not cache.resize(end):
                raise GenerationError(
                    f"prompt of {counted(len(tokens), 'token')} does not fit the prefill side's GPU quota"
                )
            paged.begin([cache])
            ids = np.asarray(tokens[history:end], dtype=np.int64)
            positions = np.arange(history, end, dtype=np.int64)
            logits = transformer.forward(ids, positions, np.asarray([end - history - 1], dtype=np.int64), paged.attend)
            first = int(np.argmax(logits[0]))
            cache.commit(tokens[cache.num_committed_tokens : end])
        return cache, first
    except BaseException:
        cache.close()
        raise


def prefill_process(connection: Connection, model_name: str, options: GenerationOptions) -> None:
    """The prefill process's body: serve requests until the decode side says bye or goes away."""
    model = load_model(model_name)
    backend = ArrayBackend(options.backend)
    transformer = Transformer(model, backend)
    paged = paged_kv(model.spec, backend, options)
    sender = KVSender(paged.manager, connection, kv_format=kv_format_of(model, backend), timeout_s=HELLO_WAIT_S)
    try:
        while True:
            request = sender.next_request()
            if request is None:
                break
            try:
                cache, first = prefill(paged, transformer, request.tokens, options.chunk)
            except GenerationError as error:
                sender.send_error(request, str(error))
                continue
            try:
                sender.send_sources(request, cache, first)
            except ValueError as error:  # counts that do not fit this prompt: the decode side gets the reason
                cache.close()
                sender.send_error(request, str(error))
                continue
            try:
                sender.wait_released(request)
            finally:
                cache.close()
    finally:
        sender.close()
        paged.close()


@dataclass
class Handoff:
    """One prompt on the decode side: what moved (``plan``, READ seconds), what the decode side reused, the
    output so far (the prefill side's first token, then the decoded ones)."""

    index: int
    prompt_ids: list[int]
    reused_tokens: int
    plan: TransferPlan
    seconds: float
    naive_bytes_per_layer_group: list[int]
    output_ids: list[int]
    cache: KVCache | None


class Decoder:
    """The decode side: its own manager and a receiver on ``connection`` to a running ``prefill_process``."""

    def __init__(self, model: Model, options: GenerationOptions, connection: Connection, timeout_s: float = 120.0) -> None:
        self.model = model
        self.options = options
        self.transformer: Transformer = Transformer(model, ArrayBackend(options.backend))
        self.paged: PagedKV = paged_kv(model.spec, self.transformer.backend, options)
        try:
            self.receiver: KVReceiver = KVReceiver(
                self.paged.manager,
                connection,
                kv_format=kv_format_of(model, self.transformer.backend),
                timeout_s=timeout_s,
            )
        except BaseException:
            self.paged.close()
            raise

    def hand_off(self, index: int, tokens: list[int]) -> Handoff:
        """Prepare a cache for ``tokens``, receive the prompt's missing KV and the first token, commit the prompt.
        ``TransferError`` when the handoff failed (the cache is closed then)."""
        received = prepare_receiver(self.paged.manager, tokens)
        if received is None:
            raise GenerationError(
                f"prompt {index} ({counted(len(tokens), 'token')}) does not fit the decode side's GPU quota"
            )
        cache, counts = received
        reused = cache.num_committed_tokens
        result = self.receiver.receive(cache, tokens, counts)
        if not isinstance(result.extra, int):
            cache.close()
            raise TransferError(f"prompt {index}: the prefill side sent {result.extra!r}, not the first token")
        cache.commit(tokens[cache.num_committed_tokens :])
        return Handoff(index, tokens, reused, result.plan, result.seconds, self.naive_bytes(len(tokens)),
                       [result.extra], cache)

    def naive_bytes(self, prompt_len: int) -> list[int]:
        """Per layer group, the bytes of every block of the prompt: a transfer that ignores reuse and windows."""
        manager = self.paged.manager
        blocks = ceil_div(prompt_len, manager.tokens_per_block)
        return [
            blocks * sum(manager.get_slot_bytes(manager.get_pool_group_index(group)))
            for group in range(len(manager.layer_grouping))
        ]

    def decode(self, handoffs: Sequence[Handoff]) -> None:
        """Greedy decoding of every handed-off sequence in one batch, one token per step, until each has
        ``max_new_tokens`` tokens or ends with EOS; each cache is closed when its sequence ends."""
        eos = self.model.spec.eos_id
        active = [h for h in handoffs if not self._finished(h, eos)]
        for handoff in handoffs:
            if handoff not in active:
                self._close(handoff)
        while active:
            caches = [self._cache(h) for h in active]
            for handoff, cache in zip(active, caches):
                if not cache.resize(cache.capacity + 1):
                    raise GenerationError(f"sequence {handoff.index} cannot grow on the decode side's GPU quota")
            self.paged.begin(caches)
            ids = np.asarray([h.output_ids[-1] for h in active], dtype=np.int64)
            positions = np.asarray([cache.history_length for cache in caches], dtype=np.int64)
            logits = self.transformer.forward(ids, positions, np.arange(len(active), dtype=np.int64), self.paged.attend)
            for row, (handoff, cache) in enumerate(zip(active, caches)):
                cache.commit([handoff.output_ids[-1]])
                handoff.output_ids.append(int(np.argmax(logits[row])))
            for handoff in [h for h in active if self._finished(h, eos)]:
                self._close(handoff)
                active.remove(handoff)

    def close(self) -> None:
        self.receiver.close()
        self.paged.close()

    def _finished(self, handoff: Handoff, eos: int | None) -> bool:
        last = handoff.output_ids[-1]
        return len(handoff.output_ids) >= self.options.max_new_tokens or (self.options.stop_at_eos and last == eos)

    def _close(self, handoff: Handoff) -> None:
        cache = self._cache(handoff)
        cache.stop_committing()
        cache.close()
        handoff.cache = None

    def _cache(self, handoff: Handoff) -> KVCache:
        if handoff.cache is None:
            raise RuntimeError(f"sequence {handoff.index} has no cache")
        return handoff.cache
