"""Continuous batching over real prompts with greedy decoding, every K/V in the manager's pages.

The scheduling is ``batching.ContinuousBatcher`` (the simulator's too: FCFS admission, chunked prefill, preemption
by suspension, resume, recompute); this module is its engine for a real model whose next tokens are not known in
advance. A waiting prompt is tokenised when first admitted; ``create_kv_cache`` matches the longest cached prefix
of the prompt (without its last token, whose logits are needed). Each step runs one forward pass over every
prefill chunk and one over every decode token (``PagedKV`` builds the page tables; the model calls
``PagedKV.attend`` per layer); a sequence whose pass reached its last known token appends the greedy next token.
Finished sequences publish their blocks (the trailing partial one too) for the next turn of the conversation.

A follow-up prompt (``Prompt.follows``) waits for the sequence it continues and resends the whole conversation:
that sequence's prompt and completion ids, then its own text — so it reuses the conversation's cached blocks.
A sequence recomputed from scratch after its cache was closed to free memory gets the same tokens (greedy).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Final, Sequence

import numpy as np
import numpy.typing as npt

from .. import KVCache, KVCacheManager
from .._base.validation import as_bool, as_float, as_int, as_list, as_non_negative_int, check_minimums
from ..batching import BatchedRequest, BatchEngine, BatchingOptions, ContinuousBatcher, StepBoundaryInterrupts
from ..cli.held_warnings import HeldWarnings
from ..config import RemoteCacheTierConfig
from .backend import ArrayBackend
from .gguf_model import Model
from .paged import PagedKV, manager_config
from .spec import ModelSpec
from .transformer import Transformer

MIB: Final = 1 << 20
# The batch a typical step declares to the manager; far past any real engine's, planning alone would take minutes.
MAX_BATCH: Final = 65_536


class GenerationError(RuntimeError):
    """The options cannot serve the prompts (e.g. one sequence does not fit the GPU quota alone)."""


class ManagerSetupError(GenerationError):
    """No manager can be built from the options (a GPU quota without room for one page of a pool group, or quotas
    too large to allocate here); ``cause`` is the manager's own error."""

    def __init__(self, options: GenerationOptions, cause: ValueError | MemoryError) -> None:
        super().__init__(
            f"no manager for gpu_mib={options.gpu_mib}, host_mib={options.host_mib}, "
            f"tokens_per_block={options.tokens_per_block}: {cause}"
        )
        self.options = options
        self.cause = cause


@dataclass(frozen=True)
class Prompt:
    """A prompt's text; ``follows`` is the index of an earlier prompt whose conversation (prompt + completion)
    this one continues."""

    text: str
    follows: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.text, str):
            raise TypeError(f"Prompt.text must be a str, got {type(self.text).__name__} {self.text!r}")
        if self.follows is not None:
            object.__setattr__(self, "follows", as_non_negative_int(self.follows, "Prompt.follows"))


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
        # Checked here, naming the argument: the CLI passes ints, a Python caller anything (NumPy numbers accepted).
        max_new_tokens = as_int(max_new_tokens, "max_new_tokens")
        tokens_per_block = as_int(tokens_per_block, "tokens_per_block")
        host_mib, chunk = as_int(host_mib, "host_mib"), as_int(chunk, "chunk")
        max_batch = as_int(max_batch, "max_batch")
        if type(gpu_mib) is not int:  # an int is kept as given, so messages say "4 MiB"
            gpu_mib = as_float(gpu_mib, "gpu_mib")
        check_minimums((
            ("max_new_tokens", max_new_tokens, 1),
            ("tokens_per_block", tokens_per_block, 1),
            ("gpu_mib", gpu_mib, 1),
            ("host_mib", host_mib, 0),
            ("chunk", chunk, 1),
            ("max_batch", max_batch, 1),
        ))
        if max_batch > MAX_BATCH:
            raise ValueError(f"max_batch must be <= {MAX_BATCH}, got {max_batch}")
        if backend not in ("cpu", "cuda"):
            raise ValueError(f"backend must be 'cpu' or 'cuda', got {backend!r}")
        self.max_new_tokens = max_new_tokens
        self.tokens_per_block = tokens_per_block
        self.gpu_mib = gpu_mib
        self.host_mib = host_mib
        self.chunk = chunk
        self.max_batch = max_batch
        self.scratch: bool = as_bool(scratch, "scratch")
        self.backend = backend
        self.stop_at_eos: bool = as_bool(stop_at_eos, "stop_at_eos")
        self.remote = remote  # a shared remote tier below the host tier (SmolLM2 across processes in the tests)

    @property
    def gpu_quota(self) -> int:
        """The GPU tier's quota in bytes (``gpu_mib`` may be a fraction)."""
        return int(self.gpu_mib * MIB)


class GeneratedSequence(BatchedRequest):
    """One prompt's run: token ids in and out, and the logits that chose each output token (host fp32).
    Its ``request_id`` is its ``index``."""

    def __init__(self, index: int, prompt: Prompt) -> None:
        super().__init__(index, follows=prompt.follows)
        self.index = index
        self.prompt = prompt
        self.prompt_ids: list[int] = []
        self.output_ids: list[int] = []
        self.logits: list[npt.NDArray[np.float32]] = []
        self.text = ""
        self.reused_tokens = 0
        self.finished = False

    @property
    def tokens(self) -> list[int]:
        return self.prompt_ids + self.output_ids


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
        checked: list[Prompt] = []
        for index, prompt in enumerate(as_list(prompts, "prompts")):
            if not isinstance(prompt, Prompt):
                raise TypeError(f"prompts[{index}] must be a Prompt, got {type(prompt).__name__} {prompt!r}")
            checked.append(prompt)
        sequences = [GeneratedSequence(i, prompt) for i, prompt in enumerate(checked)]
        for sequence in sequences:
            follows = sequence.prompt.follows
            if follows is not None and not 0 <= follows < sequence.index:
                raise ValueError(f"prompt {sequence.index} follows {follows}, which is not an earlier prompt")
        options = self.options
        paged = checked_paged_kv(self.model.spec, self.transformer.backend, options)
        result = GenerationResult(self.model.name, options, sequences)
        engine = _ServingEngine(self, paged, result)
        batching = BatchingOptions(chunk=options.chunk, max_batch=options.max_batch)
        batcher = ContinuousBatcher(paged.manager, sequences, engine, batching)
        try:
            # Text characters bound token counts: a scheduling bug becomes an error, not an endless loop.
            work = sum(len(s.prompt.text) + options.max_new_tokens + 1 for s in sequences)
            budget = 100 + 4 * work * len(sequences)
            with StepBoundaryInterrupts() as interrupts:
                while not batcher.done:
                    if batcher.step_index > budget:
                        raise RuntimeError(f"generation made no progress within {budget} steps")
                    batcher.step()
                    interrupts.check()
            counters = paged.manager.movement_counters
            result.onboarded_pages = counters.onboarded_pages
            result.offloaded_pages = counters.offloaded_pages
        finally:
            result.steps = batcher.step_index
            result.preemptions, result.resumes, result.recomputes = batcher.preemptions, batcher.resumes, batcher.recomputes
            result.manager_s = batcher.manager_ns / 1e9
            batcher.close_all()
            paged.close()
        result.tables_s, result.append_s, result.attention_s = paged.tables_s, paged.append_s, paged.attention_s
        tokenizer = self.model.tokenizer
        for sequence in sequences:
            sequence.text = tokenizer.decode(sequence.output_ids)
        return result


def paged_kv(spec: ModelSpec, backend: ArrayBackend, options: GenerationOptions) -> PagedKV:
    """A manager and its page tables sized for ``options``; ``ManagerSetupError`` when the quotas cannot give one."""
    typical = max(64, options.chunk + options.max_new_tokens)
    try:
        config = manager_config(
            spec, backend, options.tokens_per_block, options.gpu_quota, options.host_mib * MIB, options.scratch,
            typical, options.max_batch, options.remote,
        )
        return PagedKV(spec, backend, config)
    except (ValueError, MemoryError) as error:
        raise ManagerSetupError(options, error) from error


def checked_paged_kv(
    spec: ModelSpec, backend: ArrayBackend, options: GenerationOptions, gpu_flag: str = "--gpu-mib"
) -> PagedKV:
    """``paged_kv`` whose ``max_new_tokens`` the GPU quota (set by ``gpu_flag``) can hold (``check_max_new_tokens``).
    The manager's own warnings while it is built (the typical step it was given, ``chunk + max_new_tokens`` tokens,
    cannot fit) are held until the check: a refusal says the same in the flags' words, alone on its line; else they
    are logged."""
    with HeldWarnings() as held:
        paged = paged_kv(spec, backend, options)
    try:
        check_max_new_tokens(paged.manager, options, gpu_flag)
    except GenerationError:
        paged.close()
        raise
    held.release()
    return paged


class _ServingEngine(BatchEngine[GeneratedSequence]):
    """The model's side of each step: tokenising, the forward passes, greedy decoding and the run's figures."""

    def __init__(self, server: Server, paged: PagedKV, result: GenerationResult) -> None:
        self.server: Server = server
        self.options: GenerationOptions = server.options
        self.transformer: Transformer = server.transformer
        self.paged: PagedKV = paged
        self.manager: KVCacheManager = paged.manager
        self.result: GenerationResult = result
        stats = self.manager.get_storage_statistics(0)
        windowed = [False] * len(stats)
        for layer_group, is_windowed in enumerate(paged.windowed):
            windowed[self.manager.get_pool_group_index(layer_group)] |= is_windowed
        result.pool_groups = [PoolGroupPeak(group, stat.total, windowed[group]) for group, stat in enumerate(stats)]

    def compute(self, scheduled: list[GeneratedSequence]) -> None:
        """Peaks first (after this step's resizes), then one pass over the prefill chunks, one over the decodes."""
        self._sample(scheduled)
        prefill = [s for s in scheduled if _cache(s).history_length < len(s.prompt_ids)]
        decode = [s for s in scheduled if _cache(s).history_length >= len(s.prompt_ids)]
        for group, is_prefill in ((prefill, True), (decode, False)):
            if group:
                self._forward(group, is_prefill)

    def is_done(self, request: GeneratedSequence) -> bool:
        outputs = request.output_ids
        if not outputs:
            return False
        eos = self.options.stop_at_eos and outputs[-1] == self.server.model.spec.eos_id
        return eos or len(outputs) >= self.options.max_new_tokens

    def prepare(self, request: GeneratedSequence) -> None:
        if not request.prompt_ids:
            request.prompt_ids = self._prompt_ids(request)
            request.prompt_length = len(request.prompt_ids)

    def admitted(self, requests: list[GeneratedSequence]) -> None:
        """A prompt's reuse counts at its first admission (a recomputed one reusing its own work does not)."""
        for sequence in requests:
            if sequence.requeues == 0:
                reused = _cache(sequence).num_committed_tokens
                sequence.reused_tokens = reused
                self.result.prompt_tokens += len(sequence.prompt_ids)
                self.result.reused_tokens += reused

    def finished(self, request: GeneratedSequence) -> None:
        request.finished = True

    def requeued(self, request: GeneratedSequence) -> None:
        request.output_ids.clear()
        request.logits.clear()

    def reject(self, request: GeneratedSequence) -> None:
        raise GenerationError(refusal_message(request, self.options, self.manager.max_admissible(1)))

    def _forward(self, group: list[GeneratedSequence], is_prefill: bool) -> None:
        """One forward pass over ``[history, capacity)`` of each sequence; greedy next token where it ends."""
        start = time.perf_counter()
        caches = [_cache(s) for s in group]
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

    def _sample(self, scheduled: list[GeneratedSequence]) -> None:
        """Peak GPU slots per pool group, stale SWA blocks released and scratch blocks, after this step's resizes."""
        stats = self.manager.get_storage_statistics(0)
        for peak, stat in zip(self.result.pool_groups, stats):
            peak.peak_in_use = max(peak.peak_in_use, stat.unavailable)
        stale = 0
        scratch = 0
        for sequence in scheduled:
            cache = _cache(sequence)
            for group, windowed in enumerate(self.paged.windowed):
                if not windowed:
                    continue
                stale += cache.get_num_front_blocks_removed(group)
                desc = cache.get_scratch_desc(group)
                if desc is not None:
                    scratch += len(desc.range)
        self.result.max_stale_blocks_released = max(self.result.max_stale_blocks_released, stale)
        self.result.max_scratch_blocks = max(self.result.max_scratch_blocks, scratch)


def check_max_new_tokens(manager: KVCacheManager, options: GenerationOptions, gpu_flag: str = "--gpu-mib") -> None:
    """``--max-new-tokens`` is bounded by the longest sequence the GPU quota (``gpu_flag``) can ever hold alone (one
    token a step, ``max_admissible``), a prompt token included: a larger value cannot be served whatever the
    prompt, so it is refused before any work instead of after generating up to the quota (or decoding for hours)."""
    longest = manager.max_admissible(1)
    if options.max_new_tokens >= longest:
        raise GenerationError(
            f"--max-new-tokens {options.max_new_tokens}: a sequence holds at most {longest} tokens, its prompt "
            f"included, in the GPU quota of {options.gpu_mib} MiB (--tokens-per-block {options.tokens_per_block}): "
            f"give at most {longest - 1}, or raise {gpu_flag}"
        )


def refusal_message(request: GeneratedSequence, options: GenerationOptions, longest: int) -> str:
    """Why a sequence was dropped, and the flag that helps: a prompt too long for the quota (``longest``: the
    most tokens a sequence holds there, in one-token chunks; a prompt within it fits in smaller chunks, a longer one
    in none), or (once it has generated tokens) one that grew out of it, where a smaller chunk cannot help and
    fewer new tokens can; or one that fits alone whose step needed room only sequences grown past
    ``max_util_for_resume`` held."""
    if request.refusal is not None and request.refusal.fits_empty_manager:  # it fits alone: others outgrew the limit
        return f"prompt {request.index} ({len(request.prompt_ids)} tokens) was dropped: {request.rejection}"
    reason = "" if request.refusal is None else f" ({request.refusal.detail})"
    generated = len(request.output_ids)
    if generated == 0:
        if len(request.prompt_ids) > longest:
            remedy = f"a sequence holds at most {longest} tokens there: raise --gpu-mib or shorten the prompt"
        else:
            remedy = "raise --gpu-mib or lower --chunk" if options.chunk > 1 else "raise --gpu-mib"
        return (
            f"prompt {request.index} ({len(request.prompt_ids)} tokens) does not fit in the GPU quota of "
            f"{options.gpu_mib} MiB even alone{reason}: {remedy}"
        )
    return (
        f"prompt {request.index} ({len(request.prompt_ids)} tokens) with its {generated} generated tokens no longer "
        f"fits in the GPU quota of {options.gpu_mib} MiB even alone{reason}: raise --gpu-mib or lower "
        f"--max-new-tokens (now {options.max_new_tokens})"
    )


def _cache(sequence: GeneratedSequence) -> KVCache:
    cache = sequence.cache
    if cache is None:
        raise RuntimeError(f"sequence {sequence.index} has no cache")
    return cache
