"""Loading a GGUF file: metadata, dequantized fp32 weights (``gguf``'s ``dequantize``), tokenizer.

The file is read by ``gguf_file`` (under a second for either model; ``gguf``'s own reader took 6 s for SmolLM2 and
21 s for Gemma 3 on the loaded CI-sized machine) and dequantizing takes a few seconds more, so ``load_model`` keeps
one ``Model`` per name for the life of the process.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Final

import numpy as np
import numpy.typing as npt

from .gguf_file import read_gguf_file
from .sources import gguf_path
from .spec import ModelSpec, spec_from_metadata
from .tokenizer import TextTokenizer, tokenizer_from_metadata

Weights = npt.NDArray[np.float32]



@dataclass(frozen=True)
class LayerWeights:
    """One transformer block; matrices are ``[out, in]`` as GGUF stores them. Gemma-only norms are None for llama."""

    attn_norm: Weights
    q: Weights
    k: Weights
    v: Weights
    o: Weights
    ffn_norm: Weights
    gate: Weights
    up: Weights
    down: Weights
    q_norm: Weights | None
    k_norm: Weights | None
    post_attn_norm: Weights | None
    post_ffn_norm: Weights | None


@dataclass(frozen=True)
class Model:
    """A loaded model: its shape, its fp32 host weights (embeddings tied to the output) and its tokenizer."""

    name: str
    spec: ModelSpec
    embedding: Weights
    output_norm: Weights
    layers: tuple[LayerWeights, ...]
    tokenizer: TextTokenizer


def read_gguf(path: Path) -> tuple[dict[str, object], dict[str, Weights]]:
    """``(metadata, tensors)``: every key-value field (arrays as lists) and every tensor dequantized to fp32."""
    from gguf.quants import dequantize

    metadata, described = read_gguf_file(path)
    tensors: dict[str, Weights] = {}
    for tensor in described:
        values = np.asarray(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
        tensors[tensor.name] = np.ascontiguousarray(values)
    return metadata, tensors


def model_from_gguf(name: str, path: Path) -> Model:
    metadata, tensors = read_gguf(path)
    spec = spec_from_metadata(metadata)
    gemma = spec.family == "gemma3"

    def tensor(key: str) -> Weights:
        found = tensors.get(key)
        if found is None:
            raise ValueError(f"{path}: tensor {key!r} is missing")
        return found

    layers = []
    for i in range(spec.num_layers):
        prefix = f"blk.{i}."
        layers.append(
            LayerWeights(
                attn_norm=tensor(prefix + "attn_norm.weight"),
                q=tensor(prefix + "attn_q.weight"),
                k=tensor(prefix + "attn_k.weight"),
                v=tensor(prefix + "attn_v.weight"),
                o=tensor(prefix + "attn_output.weight"),
                ffn_norm=tensor(prefix + "ffn_norm.weight"),
                gate=tensor(prefix + "ffn_gate.weight"),
                up=tensor(prefix + "ffn_up.weight"),
                down=tensor(prefix + "ffn_down.weight"),
                q_norm=tensor(prefix + "attn_q_norm.weight") if gemma else None,
                k_norm=tensor(prefix + "attn_k_norm.weight") if gemma else None,
                post_attn_norm=tensor(prefix + "post_attention_norm.weight") if gemma else None,
                post_ffn_norm=tensor(prefix + "post_ffw_norm.weight") if gemma else None,
            )
        )
    if "output.weight" in tensors:
        raise ValueError(f"{path}: an untied output matrix is not supported")
    embedding = tensor("token_embd.weight")
    if embedding.shape != (spec.vocab_size, spec.hidden):
        raise ValueError(f"{path}: token_embd is {embedding.shape}, expected {(spec.vocab_size, spec.hidden)}")
    return Model(
        name=name,
        spec=spec,
        embedding=embedding,
        output_norm=tensor("output_norm.weight"),
        layers=tuple(layers),
        tokenizer=tokenizer_from_metadata(metadata),
    )


_LOADED: Final[dict[str, Model]] = {}


def load_model(name: str) -> Model:
    """The model ``name`` (``smollm2`` or ``gemma3``), loaded once per process.

    Raises ``ModelPackageMissing`` (naming the install command) when its packages are not installed.
    """
    model = _LOADED.get(name)
    if model is None:
        model = model_from_gguf(name, gguf_path(name))
        _LOADED[name] = model
    return model
