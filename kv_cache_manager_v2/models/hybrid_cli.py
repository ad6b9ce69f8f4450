"""``generate --model bamba-tiny``: the shipped hybrid (``bamba``) served through the manager, twice.

The tiny Bamba has random weights and a 256-token vocabulary, so a prompt's tokens are its UTF-8 bytes and the
completions are not text worth reading: what the run shows is reuse. Prompts are served one at a time (a ``+``
follow-up resends its conversation, completion included), once with periodic snapshots only (every
``INTERVAL_BLOCKS`` blocks) and once with declared boundaries as well (``mamba_save_last_snapshot``: the end of
each prompt's last full block is snapshotted too), and the prefix hit rate of both is reported. With ``--check``
every sequence of both runs is compared with the whole-sequence forward of its tokens.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Final

from .. import KVCacheManager
from ..config import CacheTierConfig, GpuCacheTierConfig, HostCacheTierConfig, KVCacheManagerConfig
from ..cli.tables import Table, print_tables
from .bamba import Bamba, load_bamba
from .hybrid_paged import Generation, HybridEngine, ReuseMismatch, check_against_dense, hybrid_layers
from .serving import GenerationOptions, ManagerSetupError, Prompt, check_max_new_tokens

HYBRID_MODEL: Final = "bamba-tiny"
INTERVAL_BLOCKS: Final = 4
"""``ssm_reuse_interval`` in blocks: periodic snapshots every 4 blocks (128 tokens at the default block size)."""
MIB: Final = 1 << 20


@dataclass
class HybridRun:
    """One pass over the prompts with one snapshot policy, and (with ``--check``) its verdict."""

    last_snapshot: bool
    interval: int
    runs: list[Generation]
    max_logit_delta: float | None = None
    mismatch: str | None = None

    @property
    def prompt_tokens(self) -> int:
        return sum(len(run.prompt) for run in self.runs)

    @property
    def reused_tokens(self) -> int:
        return sum(run.reused for run in self.runs)

    @property
    def hit_rate(self) -> float:
        return self.reused_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def name(self) -> str:
        return "periodic + prompt ends (mamba_save_last_snapshot)" if self.last_snapshot else "periodic only"


def serve_hybrid(model: Bamba, prompts: list[Prompt], options: GenerationOptions, last_snapshot: bool) -> HybridRun:
    """Every prompt, in order, through one manager with the given snapshot policy."""
    tokens_per_block = options.tokens_per_block
    tiers: list[CacheTierConfig] = [GpuCacheTierConfig(int(options.gpu_mib * MIB))]
    if options.host_mib > 0:
        tiers.append(HostCacheTierConfig(options.host_mib * MIB))
    interval = INTERVAL_BLOCKS * tokens_per_block
    try:
        config = KVCacheManagerConfig(
            tokens_per_block=tokens_per_block,
            layers=hybrid_layers(model.spec, tokens_per_block),
            cache_tiers=tiers,
            vocab_size=model.spec.vocab_size,
            backend="cpu",
            ssm_reuse_interval=interval,
            mamba_save_last_snapshot=last_snapshot,
            snapshot_prefill_chunks=last_snapshot,  # "periodic only" means the interval alone
        )
        manager = KVCacheManager(config)
    except (ValueError, MemoryError) as error:
        raise ManagerSetupError(options, error) from error
    engine = HybridEngine(model, manager)
    runs: list[Generation] = []
    try:
        check_max_new_tokens(manager, options)
        for prompt in prompts:
            ids = list(prompt.text.encode("utf-8"))
            if prompt.follows is not None:
                earlier = runs[prompt.follows]
                ids = earlier.prompt + earlier.tokens + ids
            runs.append(engine.generate(ids, options.max_new_tokens, options.chunk))
    finally:
        engine.manager.shutdown()
    return HybridRun(last_snapshot, interval, runs)


def check_run(model: Bamba, run: HybridRun) -> None:
    """Compare every sequence with the dense forward; records the largest difference or the first mismatch."""
    worst = 0.0
    for index, generation in enumerate(run.runs):
        try:
            worst = max(worst, check_against_dense(model, generation))
        except ReuseMismatch as error:
            run.mismatch = f"sequence {index}: {error}"
            return
    run.max_logit_delta = worst


def run_hybrid(prompts: list[Prompt], options: GenerationOptions, check: bool, as_json: bool, plain: bool) -> int:
    """The ``generate`` subcommand for ``bamba-tiny``: 0, or 1 when ``--check`` found a difference."""
    model = load_bamba()
    results = [serve_hybrid(model, prompts, options, last_snapshot) for last_snapshot in (False, True)]
    if check:
        for result in results:
            check_run(model, result)
    if as_json:
        print(json.dumps(hybrid_json(prompts, results, check), indent=2))
    else:
        for index, generation in enumerate(results[0].runs):
            print(f"[{index}] {prompts[index].text!r}")
            print(f"    -> token ids {generation.tokens}")
        print()
        print_tables(hybrid_tables(results, check), plain=plain)
    return 1 if any(result.mismatch is not None for result in results) else 0


def hybrid_tables(results: list[HybridRun], check: bool) -> list[Table]:
    rows = []
    for result in results:
        row = [
            result.name,
            f"{result.interval}",
            f"{100 * result.hit_rate:.1f}% ({result.reused_tokens} of {result.prompt_tokens})",
            ", ".join(f"{run.reused}" for run in result.runs),
        ]
        if check:
            row.append(result.mismatch or f"yes (max |Δ logit| {result.max_logit_delta:.1e})")
        rows.append(row)
    columns = ["snapshots", "interval", "prefix hit rate", "reused per prompt"]
    if check:
        columns.append("equal to dense")
    note = "tokens are UTF-8 bytes (random weights, vocabulary 256); prompts served one at a time"
    return [Table(f"{HYBRID_MODEL} (Mamba-2 + attention) on cpu: SSM snapshot reuse", columns, rows, note)]


def hybrid_json(prompts: list[Prompt], results: list[HybridRun], check: bool) -> dict[str, object]:
    output: dict[str, object] = {
        "model": HYBRID_MODEL,
        "runs": [
            {
                "last_snapshot": result.last_snapshot,
                "ssm_reuse_interval": result.interval,
                "prompt_tokens": result.prompt_tokens,
                "reused_tokens": result.reused_tokens,
                "prefix_hit_rate": result.hit_rate,
                "sequences": [
                    {"prompt": prompt.text, "follows": prompt.follows, "prompt_ids": run.prompt,
                     "output_ids": run.tokens, "reused_tokens": run.reused}
                    for prompt, run in zip(prompts, result.runs)
                ],
                **({"equal_to_dense": result.mismatch is None, "max_logit_delta": result.max_logit_delta,
                    "mismatch": result.mismatch} if check else {}),
            }
            for result in results
        ],
    }
    return output
