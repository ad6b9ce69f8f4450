"""Tokenizers built from the GGUF files' own vocabularies (``tokenizers`` library), checked against known ids,
the files' vocabularies and, for Gemma's SentencePiece model, a direct SentencePiece-BPE reference."""

from __future__ import annotations

import pytest

from kv_cache_manager_v2.models.tokenizer import TOKEN_NORMAL, sentencepiece_merges
from tests.model_helpers import require_model


def test_sentencepiece_merges_rank_pairs_by_the_merged_piece() -> None:
    tokens = ["<unk>", "a", "b", "c", "ab", "bc", "abc", "<ctl>"]
    scores = [0.0, -1.0, -2.0, -3.0, -5.0, -4.0, -6.0, 0.0]
    types = [2, 1, 1, 1, 1, 1, 1, 3]
    # "bc" (-4) outranks "ab" (-5), which outranks "abc" (-6, two splits: "a"+"bc" and "ab"+"c").
    assert sentencepiece_merges(tokens, scores, types) == [("b", "c"), ("a", "b"), ("a", "bc"), ("ab", "c")]


def test_smollm2_ids() -> None:
    tokenizer = require_model("smollm2").tokenizer
    # Ids measured independently (a plain NumPy forward pass continues them with " Paris.").
    assert tokenizer.encode("The capital of France is") == [504, 3575, 282, 4649, 314]
    ids = tokenizer.encode("Hello world! 2024")
    # llama.cpp's smollm pre-tokenizer: every digit alone, then the GPT-2 split (spaces as Ġ).
    assert tokenizer.pieces(ids) == ["Hello", "Ġworld", "!", "Ġ", "2", "0", "2", "4"]
    assert tokenizer.encode("<|im_start|>user") == [1, 4093]  # control token matched whole
    for text in ["naïve café 😀", "tabs\tand\nnewlines", "  leading spaces"]:
        assert tokenizer.decode(tokenizer.encode(text)) == text


def spm_reference(text: str, vocab: list[str], scores: list[float], types: list[int]) -> list[int]:
    """SentencePiece BPE as llama.cpp runs it: split into characters, repeatedly merge the adjacent pair whose
    concatenation is the best-scoring normal piece (leftmost on ties), then byte fallback for unknown symbols."""
    ids = {piece: i for i, piece in reversed(list(enumerate(vocab)))}
    symbols = list(text.replace(" ", "▁"))
    while True:
        best: tuple[float, int] | None = None
        for i in range(len(symbols) - 1):
            merged = ids.get(symbols[i] + symbols[i + 1])
            if merged is not None and types[merged] == TOKEN_NORMAL and (best is None or -scores[merged] < best[0]):
                best = (-scores[merged], i)
        if best is None:
            break
        i = best[1]
        symbols[i : i + 2] = [symbols[i] + symbols[i + 1]]
    out: list[int] = []
    for symbol in symbols:
        if symbol in ids:
            out.append(ids[symbol])
        else:
            out.extend(ids[f"<0x{byte:02X}>"] for byte in symbol.encode("utf-8"))
    return out


def test_gemma3_ids() -> None:
    model = require_model("gemma3")
    tokenizer = model.tokenizer
    ids = tokenizer.encode("The capital of France is")
    assert tokenizer.pieces(ids) == ["The", "▁capital", "▁of", "▁France", "▁is"]
    assert ids == [tokenizer.vocab.index(piece) for piece in ["The", "▁capital", "▁of", "▁France", "▁is"]]
    assert model.spec.bos_id == 2 and tokenizer.vocab[2] == "<bos>"
    assert tokenizer.encode("<start_of_turn>user\n") == [105, 2364, 107]  # control and user-defined tokens whole


@pytest.mark.parametrize(
    "text",
    [
        "Once upon a time, in a small village by the sea",
        "unbelievably hyperparameterized tokenization",
        "naïve café, 12345 and 3.14159",
        "emoji 😀 and a rare character \u0378",  # U+0378 is unassigned: byte fallback
    ],
)
def test_gemma3_matches_a_sentencepiece_reference(text: str) -> None:
    tokenizer = require_model("gemma3").tokenizer
    reference = spm_reference(text, list(tokenizer.vocab), list(tokenizer.scores), list(tokenizer.token_types))
    assert tokenizer.encode(text) == reference
    assert tokenizer.decode(tokenizer.encode(text)) == text
