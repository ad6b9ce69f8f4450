"""Continuous batching over real prompts with greedy decoding, every K/V in the manager's pages.

The scheduling is the simulator's (``sim/scheduler.py``), applied to a real model whose next tokens are not known in
advance:

1. *Running* sequences are scheduled in admission order: a prefill chunk of at most ``chunk`` tokens, or one
   decode token. ``resize`` grows the cache; when it returns False the most recently admitted running sequence is
   preempted by ``suspend()`` (its pages stay cached and may be offloaded to the host tier) and the resize is
   retried.
2. If nothing was preempted, suspended sequences are resumed (FCFS; ``resume`` onboards what was offloaded), then
   waiting prompts are admitted: ``create_kv_cache`` matches the longest cached prefix of the prompt (without its
   last token, whose logits are needed) in the radix tree, ``resume`` + ``resize`` for the first chunk.
3. One forward pass over every prefill chunk of the step, one over every decode token (``PagedKV`` builds the
   page tables; the model calls ``PagedKV.attend`` per layer); a sequence whose pass reached its last known token
   appends the greedy next token. Computed tokens are committed; finished sequences ``stop_committing`` and
   ``close`` (publishing the trailing partial block for the next turn of the conversation).

A follow-up prompt (``Prompt.follows``) waits for the sequence it continues and resends the whole conversation:
that sequence's prompt and completion ids, then its own text — so it reuses the conversation's cached blocks.
When suspended sequences pin the GPU with no colder tier to go to, the most recently admitted one is closed and
recomputed from scratch (greedy decoding gives the same tokens).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Final, Sequence, TypeVar

import numpy as np
import numpy.typing as npt

from .._manager.manager import _KVCache
from .._base.validation import check_minimums
from ..config import RemoteCacheTierConfig
from .backend import ArrayBackend
from .gguf_model import Model
from .paged import PagedKV, manager_config
from .transformer import Transformer

MIB: Final = 1 << 20
_T = TypeVar("_T")


class GenerationError(RuntimeError):
    """The options cannot serve the prompts (e.g. one sequence does not fit the GPU quota alone)."""


@dataclass(frozen=True)
class Prompt:
    """A prompt's text; ``follows`` is the index of an earlier prompt whose conversation (prompt + completion)
    this one continues."""

    text: str
    follows: int | None = None


class GenerationOptions:
    """How to serve: decoding length, block size, GPU and host quotas, chunking, batch size, scratch reuse.

    ``gpu_mib`` may be a fraction: the cuda backend's fp16 pages are half the size of the cpu backend's fp32
    ones, so half a cpu run's quota holds the same blocks.
    """

    def __init__(
        self,
        max_new_tokens: int = 16,
        tokens_per_block: int = 32,
        gpu_mib: float = 256,
        host_mib: int = 512,
        chunk: int = 256,
        max_batch: int = 8,
        scratch: bool = False,
        backend: str = "cpu",
        stop_at_eos: bool = True,
        remote: RemoteCacheTierConfig | None = None,
    ) -> None:
        check_minimums((
            ("max_new_tokens", max_new_tokens, 1),
            ("tokens_per_block", tokens_per_block, 1),
            ("gpu_mib", gpu_mib, 1),
            ("host_mib", host_mib, 0),
            ("chunk", chunk, 1),
            ("max_batch", max_batch, 1),
        ))
        self.max_new_tokens = max_new_tokens
        self.tokens_per_block = tokens_per_block
        self.gpu_mib = gpu_mib
        self.host_mib = host_mib
        self.chunk = chunk
        self.max_batch = max_batch
        self.scratch = scratch
        self.backend = backend
        self.stop_at_eos = stop_at_eos
        self.remote = remote  # a shared remote tier below the host tier (SmolLM2 across processes in the tests)

    @property
    def gpu_quota(self) -> int:
        """The GPU tier's quota in bytes (``gpu_mib`` may be a fraction)."""
        return int(self.gpu_mib * MIB)


class GeneratedSequence:
    """One prompt's run: token ids in and out, and the logits that chose each output token (host fp32)."""

    def __init__(self, index: int, prompt: Prompt) -> None:
        self.index = index
        self.prompt = prompt
        self.prompt_ids: list[int] = []
        self.output_ids: list[int] = []
        self.logits: list[npt.NDArray[np.float32]] = []
        self.text = ""
        self.reused_tokens = 0
        self.cache: _KVCache | None = None
        self.admitted = 0
        self.finished = False

    @property
    def tokens(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    def next_target(self, chunk: int, history: int) -> int:
        """Capacity to schedule: a prefill chunk, else one decode token (the last output token's K/V)."""
        if history < len(self.prompt_ids):
            return min(len(self.prompt_ids), history + chunk)
        return history + 1


class PoolGroupPeak:
    """GPU slots of one pool group: its total and the most in use (locked or pinned) after any step's resizes;
    ``windowed`` when it holds sliding-window layers."""

    def __init__(self, pool_group: int, total: int, windowed: bool) -> None:
        self.pool_group = pool_group
        self.total = total
        self.windowed = windowed
        self.peak_in_use = 0


class GenerationResult:
    """Everything a run produced and measured (the CLI prints it; tests assert on it)."""

    def __init__(self, model_name: str, options: GenerationOptions, sequences: list[GeneratedSequence]) -> None:
        self.model_name = model_name
        self.options = options
        self.sequences = sequences
        self.steps = 0
        self.prompt_tokens = 0
        self.reused_tokens = 0
        self.prefill_tokens = 0
        self.decode_tokens = 0
        self.prefill_s: float = 0.0
        self.decode_s: float = 0.0
        self.manager_s: float = 0.0
        self.tables_s: float = 0.0
        self.append_s: float = 0.0
        self.attention_s: float = 0.0
        self.preemptions = 0
        self.resumes = 0
        self.recomputes = 0
        self.onboarded_pages = 0
        self.offloaded_pages = 0
        self.max_stale_blocks_released = 0
        self.max_scratch_blocks = 0
        self.pool_groups: list[PoolGroupPeak] = []

    @property
    def hit_rate(self) -> float:
        return self.reused_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


class Server:
    """One model on one backend behind one manager; ``run`` serves a list of prompts to the end."""

    def __init__(self, model: Model, options: GenerationOptions, transformer: Transformer | None = None) -> None:
        self.model = model
        self.options = options
        self.transformer: Transformer = transformer if transformer is not None else Transformer(model, ArrayBackend(options.backend))
        if self.transformer.backend.name != options.backend:
            raise ValueError(
                f"transformer backend {self.transformer.backend.name!r} differs from options.backend "
                f"{options.backend!r}"
            )

    def run(self, prompts: Sequence[Prompt]) -> GenerationResult:
        sequences = [GeneratedSequence(i, prompt) for i, prompt in enumerate(prompts)]
        for sequence in sequences:
            follows = sequence.prompt.follows
            if follows is not None and not 0 <= follows < sequence.index:
                raise ValueError(f"prompt {sequence.index} follows {follows}, which is not an earlier prompt")
        options = self.options
        spec = self.model.spec
        typical = max(64, options.chunk + options.max_new_tokens)
        config = manager_config(
            spec,
            self.transformer.backend,
            options.tokens_per_block,
            options.gpu_quota,
            options.host_mib * MIB,
            options.scratch,
            typical,
            options.max_batch,
            options.remote,
        )
        paged = PagedKV(spec, self.transformer.backend, config)
        result = GenerationResult(self.model.name, options, sequences)
        loop = _Loop(self, paged, result)
        try:
            loop.run()
        finally:
            loop.close_all()
            paged.close()
        result.tables_s, result.append_s, result.attention_s = paged.tables_s, paged.append_s, paged.attention_s
        tokenizer = self.model.tokenizer
        for sequence in sequences:
            sequence.text = tokenizer.decode(sequence.output_ids)
        return result


class _Loop:
    """The scheduler's queues and one step at a time (see the module docstring)."""

    def __init__(self, server: Server, paged: PagedKV, result: GenerationResult) -> None:
        self.server = server
        self.options = server.options
        self.transformer = server.transformer
        self.paged = paged
        self.manager = paged.manager
        self.result = result
        self.waiting: list[GeneratedSequence] = list(result.sequences)
        self.suspended: list[GeneratedSequence] = []
        self.running: list[GeneratedSequence] = []
        self.admissions = 0
        self.preempted = False
        stats = self.manager.get_storage_statistics(0)
        windowed = [False] * len(stats)
        for layer_group, is_windowed in enumerate(paged.windowed):
            windowed[self.manager.get_pool_group_index(layer_group)] |= is_windowed
        result.pool_groups = [PoolGroupPeak(group, stat.total, windowed[group]) for group, stat in enumerate(stats)]

    def run(self) -> None:
        result = self.result
        # Text characters bound token counts: a scheduling bug becomes an error, not an endless loop.
        work = sum(len(s.prompt.text) + self.options.max_new_tokens + 1 for s in result.sequences)
        budget = 100 + 4 * work * len(result.sequences)
        while not all(sequence.finished for sequence in result.sequences):
            if result.steps > budget:
                raise RuntimeError(f"generation made no progress within {budget} steps")
            self.step()
        counters = self.manager.movement_counters
        result.onboarded_pages = counters.onboarded_pages
        result.offloaded_pages = counters.offloaded_pages

    def step(self) -> None:
        result = self.result
        result.steps += 1
        self.preempted = False
        scheduled = self._schedule_running()
        if not self.preempted:
            scheduled.extend(self._admit())
        if not scheduled:
            self._unblock()
            return
        self._sample()
        prefill = [s for s in scheduled if self._cache(s).history_length < len(s.prompt_ids)]
        decode = [s for s in scheduled if self._cache(s).history_length >= len(s.prompt_ids)]
        for group, is_prefill in ((prefill, True), (decode, False)):
            if group:
                self._compute(group, is_prefill)
        for sequence in scheduled:
            cache = self._cache(sequence)
            tokens = sequence.tokens[cache.num_committed_tokens : cache.capacity]
            self._timed(lambda: cache.commit(tokens))
            if self._done(sequence):
                self._finish(sequence)

    def close_all(self) -> None:
        for sequence in self.running + self.suspended + self.waiting:
            if sequence.cache is not None:
                sequence.cache.close()
                sequence.cache = None

    # ------------------------------------------------------------------------------------------- computing
    def _compute(self, group: list[GeneratedSequence], is_prefill: bool) -> None:
        """One forward pass over ``[history, capacity)`` of each sequence; greedy next token where it ends."""
        start = time.perf_counter()
        caches = [self._cache(s) for s in group]
        ids = np.concatenate(
            [np.asarray(s.tokens[c.history_length : c.capacity], dtype=np.int64) for s, c in zip(group, caches)]
        )
        ends = np.cumsum([c.capacity - c.history_length for c in caches]) - 1
        producing = [i for i, (s, c) in enumerate(zip(group, caches)) if c.capacity == len(s.tokens)]
        self.paged.begin(caches)
        positions = np.concatenate([np.arange(c.history_length, c.capacity, dtype=np.int64) for c in caches])
        logits = self.transformer.forward(ids, positions, ends[producing].astype(np.int64), self.paged.attend)
        for row, i in enumerate(producing):
            group[i].logits.append(logits[row])
            group[i].output_ids.append(int(np.argmax(logits[row])))
        elapsed = time.perf_counter() - start
        computed = int(ids.shape[0])
        if is_prefill:
            self.result.prefill_s += elapsed
            self.result.prefill_tokens += computed
        else:
            self.result.decode_s += elapsed
            self.result.decode_tokens += computed

    def _done(self, sequence: GeneratedSequence) -> bool:
        outputs = sequence.output_ids
        if not outputs:
            return False
        eos = self.options.stop_at_eos and outputs[-1] == self.server.model.spec.eos_id
        return eos or len(outputs) >= self.options.max_new_tokens

    # ------------------------------------------------------------------------------------------ scheduling
    def _schedule_running(self) -> list[GeneratedSequence]:
        scheduled: list[GeneratedSequence] = []
        position = 0
        while position < len(self.running):
            sequence = self.running[position]
            cache = self._cache(sequence)
            target = sequence.next_target(self.options.chunk, cache.history_length)
            while not self._resize(cache, target):
                victim = self.running[-1]
                self._preempt(victim)
                if victim is sequence:
                    break
            else:
                scheduled.append(sequence)
                position += 1
        return scheduled

    def _admit(self) -> list[GeneratedSequence]:
        scheduled: list[GeneratedSequence] = []
        while self.suspended and len(self.running) < self.options.max_batch:
            sequence = self.suspended[0]
            cache = self._cache(sequence)
            if not self._timed(cache.resume):
                return scheduled
            if not self._resize(cache, sequence.next_target(self.options.chunk, cache.history_length)):
                self._timed(cache.suspend)
                return scheduled
            del self.suspended[0]
            self.result.resumes += 1
            self._start(sequence)
            scheduled.append(sequence)
        while len(self.running) < self.options.max_batch:
            candidate = self._next_admissible()
            if candidate is None or not self._create(candidate):
                break
            self.waiting.remove(candidate)
            self._start(candidate)
            scheduled.append(candidate)
        return scheduled

    def _next_admissible(self) -> GeneratedSequence | None:
        for sequence in self.waiting:
            follows = sequence.prompt.follows
            if follows is None or self.result.sequences[follows].finished:
                return sequence
        return None

    def _create(self, sequence: GeneratedSequence) -> bool:
        if not sequence.prompt_ids:
            sequence.prompt_ids = self._prompt_ids(sequence)
        prompt = sequence.prompt_ids
        cache = self._timed(lambda: self.manager.create_kv_cache(None, prompt[:-1], id=sequence.index))
        if self._timed(cache.resume):
            reused = cache.num_committed_tokens
            if self._resize(cache, sequence.next_target(self.options.chunk, reused)):
                sequence.cache = cache
                if sequence.reused_tokens == 0 and not sequence.output_ids:
                    sequence.reused_tokens = reused
                    self.result.prompt_tokens += len(prompt)
                    self.result.reused_tokens += reused
                return True
        self._timed(cache.close)
        return False

    def _prompt_ids(self, sequence: GeneratedSequence) -> list[int]:
        model = self.server.model
        text_ids = model.tokenizer.encode(sequence.prompt.text)
        follows = sequence.prompt.follows
        if follows is not None:
            return self.result.sequences[follows].tokens + text_ids
        bos = model.spec.bos_id
        ids = ([] if bos is None else [bos]) + text_ids
        if not ids:
            raise GenerationError(f"prompt {sequence.index} is empty")
        return ids

    def _start(self, sequence: GeneratedSequence) -> None:
        self.admissions += 1
        sequence.admitted = self.admissions
        self.running.append(sequence)

    def _preempt(self, victim: GeneratedSequence) -> None:
        cache = self._cache(victim)
        if cache.capacity > cache.history_length:
            self._resize(cache, cache.history_length)
        self._timed(cache.suspend)
        self.running.remove(victim)
        self.suspended.append(victim)
        self.suspended.sort(key=_index)
        self.result.preemptions += 1
        self.preempted = True

    def _unblock(self) -> None:
        """Nothing could be scheduled: recompute a suspended sequence that pins memory, or give up clearly."""
        if self.running:
            return
        if len(self.suspended) > 1:
            victim = max(self.suspended, key=_admission)
            self.suspended.remove(victim)
            self._timed(self._cache(victim).close)
            victim.cache = None
            victim.output_ids.clear()
            victim.logits.clear()
            self.waiting.append(victim)
            self.waiting.sort(key=_index)
            self.result.recomputes += 1
            return
        stuck = self.suspended[0] if self.suspended else self._next_admissible()
        if stuck is None:
            raise RuntimeError("no sequence is running, suspended or admissible, yet some are unfinished")
        raise GenerationError(
            f"prompt {stuck.index} ({len(stuck.prompt_ids)} tokens) does not fit in the GPU quota of "
            f"{self.options.gpu_mib} MiB even alone: raise --gpu-mib or lower --chunk"
        )

    def _finish(self, sequence: GeneratedSequence) -> None:
        cache = self._cache(sequence)
        self._timed(cache.stop_committing)
        self._timed(cache.close)
        sequence.cache = None
        sequence.finished = True
        self.running.remove(sequence)

    # ---------------------------------------------------------------------------------------- measurements
    def _sample(self) -> None:
        """Peak GPU slots per pool group, stale SWA blocks released and scratch blocks, after this step's resizes."""
        stats = self.manager.get_storage_statistics(0)
        for peak, stat in zip(self.result.pool_groups, stats):
            peak.peak_in_use = max(peak.peak_in_use, stat.unavailable)
        stale = 0
        scratch = 0
        for sequence in self.running:
            cache = self._cache(sequence)
            for group, windowed in enumerate(self.paged.windowed):
                if not windowed:
                    continue
                stale += cache.get_num_front_blocks_removed(group)
                desc = cache.get_scratch_desc(group)
                if desc is not None:
                    scratch += len(desc.range)
        self.result.max_stale_blocks_released = max(self.result.max_stale_blocks_released, stale)
        self.result.max_scratch_blocks = max(self.result.max_scratch_blocks, scratch)

    def _cache(self, sequence: GeneratedSequence) -> _KVCache:
        cache = sequence.cache
        if cache is None:
            raise RuntimeError(f"sequence {sequence.index} has no cache")
        return cache

    def _resize(self, cache: _KVCache, capacity: int) -> bool:
        return self._timed(lambda: cache.resize(capacity))

    def _timed(self, call: Callable[[], _T]) -> _T:
        start = time.perf_counter()
        try:
            return call()
        finally:
            self.result.manager_s += time.perf_counter() - start


def _index(sequence: GeneratedSequence) -> int:
    return sequence.index


def _admission(sequence: GeneratedSequence) -> int:
    return sequence.admitted
