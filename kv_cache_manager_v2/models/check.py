"""The dense reference check: every sequence of a paged run, run again alone with contiguous K/V arrays.

Each sequence's prompt ids (as the paged run built them, conversation included) go through the same
``Transformer`` in one prefill pass, then greedy decoding token by token with ``DenseKV``. The check passes when
every output id sequence is identical; ``max_logit_delta`` is the largest ``|paged - dense|`` over the logits
of the steps both produced. On cpu both sides keep fp32 K/V and attend in float64, so it measures batching and
summation-order noise (``LOGIT_TOLERANCES["cpu"]``, measured deltas ~5e-5); on cuda the paged side keeps fp16 K/V
(``LOGIT_TOLERANCES["cuda"]``; measured on an H100: 2.2e-2 for SmolLM2 and for Gemma 3, so the bound keeps a 4x
margin and still fails a kernel that is wrong by more than fp16 rounding).
"""

from __future__ import annotations

import time
from typing import Final

import numpy as np

from .dense import DenseKV
from .serving import GenerationResult
from .transformer import Transformer

LOGIT_TOLERANCES: Final = {"cpu": 2e-3, "cuda": 0.1}
"""Largest ``|paged - dense|`` logit accepted per backend (see the module docstring)."""


class SequenceCheck:
    def __init__(self, index: int, output_ids: list[int], equal: bool, max_logit_delta: float) -> None:
        self.index = index
        self.output_ids = output_ids
        self.equal = equal
        self.max_logit_delta = max_logit_delta


class CheckResult:
    """Per-sequence verdicts, the overall one, and the dense path's own throughput."""

    def __init__(self, sequences: list[SequenceCheck], prefill_tokens: int, prefill_s: float, decode_tokens: int,
                 decode_s: float) -> None:
        self.sequences = sequences
        self.prefill_tokens = prefill_tokens
        self.prefill_s = prefill_s
        self.decode_tokens = decode_tokens
        self.decode_s = decode_s

    @property
    def all_equal(self) -> bool:
        return all(check.equal for check in self.sequences)

    @property
    def max_logit_delta(self) -> float:
        return max((check.max_logit_delta for check in self.sequences), default=0.0)

    def within_tolerance(self, backend: str) -> bool:
        return self.max_logit_delta <= LOGIT_TOLERANCES[backend]


def check_against_dense(transformer: Transformer, result: GenerationResult) -> CheckResult:
    spec = transformer.spec
    options = result.options
    checks: list[SequenceCheck] = []
    prefill_tokens = decode_tokens = 0
    prefill_s = decode_s = 0.0
    for sequence in result.sequences:
        kv = DenseKV(spec, transformer.backend)
        outputs: list[int] = []
        deltas: list[float] = []
        step_ids = sequence.prompt_ids
        while True:
            start = time.perf_counter()
            kv.begin(len(step_ids))
            positions = np.arange(kv.length - len(step_ids), kv.length, dtype=np.int64)
            last = np.array([len(step_ids) - 1], dtype=np.int64)
            logits = transformer.forward(np.asarray(step_ids, dtype=np.int64), positions, last, kv.attend)[0]
            elapsed = time.perf_counter() - start
            if outputs:
                decode_s += elapsed
                decode_tokens += len(step_ids)
            else:
                prefill_s += elapsed
                prefill_tokens += len(step_ids)
            step = len(outputs)
            if step < len(sequence.logits):
                deltas.append(float(np.abs(sequence.logits[step] - logits).max()))
            outputs.append(int(np.argmax(logits)))
            eos = options.stop_at_eos and outputs[-1] == spec.eos_id
            if eos or len(outputs) >= options.max_new_tokens:
                break
            step_ids = outputs[-1:]
        equal = outputs == sequence.output_ids
        checks.append(SequenceCheck(sequence.index, outputs, equal, max(deltas, default=0.0)))
    return CheckResult(checks, prefill_tokens, prefill_s, decode_tokens, decode_s)
