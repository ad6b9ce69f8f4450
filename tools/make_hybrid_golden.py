"""Regenerate the tiny Bamba's weights and golden logits (``kv_cache_manager_v2/models/data/``).

Needs torch (CPU build) and transformers, which the package and its tests do not: run it in a separate venv::

    python3 -m venv /tmp/hfvenv && /tmp/hfvenv/bin/pip install "torch==2.13.0" transformers numpy
    /tmp/hfvenv/bin/python tools/make_hybrid_golden.py

transformers' ``BambaForCausalLM`` is built from a seeded random initialisation of a small config, its weights are
saved as ``.npz`` (names as in its state dict, the config as JSON), and its own logits for fixed prompts are stored
beside them: the whole-sequence forward, and greedy tokens decoded with its hybrid cache. The script also measures
how far transformers' cached continuation drifts from its own whole-sequence forward, the yardstick for the NumPy
model's tolerances (printed, and stored as ``hf_cached_vs_full``).
"""

from __future__ import annotations

import json
import pathlib
import sys
from typing import Any

import numpy as np

SEED = 40
CONFIG: dict[str, Any] = {
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 4,
    "attn_layer_indices": [1, 3],
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "mamba_n_heads": 8,
    "mamba_n_groups": 2,
    "mamba_d_state": 16,
    "mamba_d_conv": 4,
    "mamba_expand": 2,
    "mamba_chunk_size": 16,
    "rms_norm_eps": 1e-5,
    "initializer_range": 0.1,
    "tie_word_embeddings": False,
    "pad_token_id": None,
    "bos_token_id": None,
    "eos_token_id": None,
}
PROMPT_LENGTHS = (23, 64, 100)
NEW_TOKENS = 8
DATA = pathlib.Path(__file__).resolve().parents[1] / "kv_cache_manager_v2" / "models" / "data"


def main() -> int:
    import torch
    from transformers import BambaConfig, BambaForCausalLM

    torch.manual_seed(SEED)
    config = BambaConfig(**CONFIG, use_mamba_kernels=False)
    model = BambaForCausalLM(config).eval().to(torch.float32)
    prompts = np.random.default_rng(SEED).integers(0, CONFIG["vocab_size"], size=sum(PROMPT_LENGTHS))
    splits = np.split(prompts, np.cumsum(PROMPT_LENGTHS)[:-1])
    golden: dict[str, np.ndarray] = {}
    worst = 0.0
    with torch.no_grad():
        for index, prompt in enumerate(splits):
            ids = torch.tensor(prompt[None, :], dtype=torch.long)
            full = model(ids, use_cache=False).logits[0].numpy()
            generated = model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False, use_cache=True)
            tokens = generated[0, len(prompt):].numpy()
            # The cached run's logits against the whole sequence's, at every generated position.
            cached = model.generate(
                ids, max_new_tokens=NEW_TOKENS, do_sample=False, use_cache=True, output_logits=True,
                return_dict_in_generate=True,
            )
            whole = model(generated, use_cache=False).logits[0].numpy()
            steps = np.stack([step[0].numpy() for step in cached.logits])
            drift = float(np.abs(steps - whole[len(prompt) - 1 : len(prompt) - 1 + NEW_TOKENS]).max())
            worst = max(worst, drift)
            golden[f"prompt{index}"] = prompt.astype(np.int64)
            golden[f"logits{index}"] = full.astype(np.float32)
            golden[f"greedy{index}"] = tokens.astype(np.int64)
            print(f"prompt {index}: {len(prompt)} tokens, |logits| max {np.abs(full).max():.3f}, "
                  f"cached vs full max diff {drift:.3e}, greedy {tokens.tolist()}")
    DATA.mkdir(parents=True, exist_ok=True)
    weights = {name: tensor.detach().numpy().astype(np.float32) for name, tensor in model.state_dict().items()}
    rope = config.rope_parameters
    saved_config = dict(
        CONFIG, model_type="bamba", seed=SEED, rope_theta=float(rope["rope_theta"]),
        partial_rotary_factor=float(rope["partial_rotary_factor"]),
    )
    arrays: dict[str, Any] = {"config": np.array(json.dumps(saved_config)), **weights}
    np.savez_compressed(DATA / "bamba_tiny.npz", **arrays)
    golden["hf_cached_vs_full"] = np.array(worst, dtype=np.float64)
    golden_arrays: dict[str, Any] = golden
    np.savez_compressed(DATA / "bamba_tiny_golden.npz", **golden_arrays)
    print(f"worst cached vs full: {worst:.3e}; wrote {DATA}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
