"""Tokenizers built from a GGUF file's own vocabulary with the ``tokenizers`` library (no hand-written BPE).

- ``gpt2`` (SmolLM2): byte-level BPE with the GGUF's merge list; pre-tokenized as llama.cpp's ``smollm`` does:
  every digit alone, then the GPT-2 split regex.
- ``llama`` (Gemma 3): SentencePiece BPE. The GGUF holds pieces and scores but no merges; SentencePiece merges,
  at each step, the adjacent pair whose concatenation is the highest-scoring piece, which is BPE with the merge
  ``(a, b)`` ranked by the score of ``a + b``. So every split of every normal piece into two pieces is a merge,
  ranked by the piece's score (ties by id). Spaces become ``▁``; unknown characters fall back to ``<0xNN>`` bytes.

Control tokens (``<bos>``, ``<start_of_turn>``, ``<|im_start|>``, ...) are special tokens matched whole;
user-defined ones (Gemma's runs of newlines, spaces and tabs, HTML tags) are matched whole before BPE, as llama.cpp
does. The BOS token is not added here: ``ModelSpec.bos_id`` says whether prompts start with it.
"""

from __future__ import annotations

from typing import Final, Mapping, Sequence

TOKEN_NORMAL: Final = 1
TOKEN_CONTROL: Final = 3
TOKEN_USER_DEFINED: Final = 4


class TextTokenizer:
    """Text to token ids and back (a thin typed wrapper around ``tokenizers.Tokenizer``)."""

    def __init__(
        self, backend: object, vocab: Sequence[str], scores: Sequence[float], token_types: Sequence[int]
    ) -> None:
        from tokenizers import Tokenizer

        if not isinstance(backend, Tokenizer):
            raise TypeError(f"backend must be a tokenizers.Tokenizer, got {type(backend).__name__}")
        self._backend = backend
        self.vocab = vocab
        self.scores = scores  # empty for byte-level BPE (it ranks merges, not pieces)
        self.token_types = token_types

    def encode(self, text: str) -> list[int]:
        return list(self._backend.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: Sequence[int]) -> str:
        return self._backend.decode(list(ids), skip_special_tokens=False)

    def pieces(self, ids: Sequence[int]) -> list[str]:
        """The GGUF vocabulary entry of each id (for checks against the file's own vocabulary)."""
        return [self.vocab[i] for i in ids]


def tokenizer_from_metadata(metadata: Mapping[str, object]) -> TextTokenizer:
    kind = str(metadata["tokenizer.ggml.model"])
    tokens = _strings(metadata, "tokenizer.ggml.tokens")
    types = _ints(metadata, "tokenizer.ggml.token_type")
    if len(types) != len(tokens):
        raise ValueError(f"GGUF has {len(tokens)} tokens but {len(types)} token types")
    scores: list[float] = []
    if kind == "gpt2":
        backend = _byte_level_bpe(tokens, _strings(metadata, "tokenizer.ggml.merges"))
    elif kind == "llama":
        scores = _floats(metadata, "tokenizer.ggml.scores")
        backend = _sentencepiece_bpe(tokens, scores, types)
    else:
        raise ValueError(f"GGUF tokenizer model {kind!r} is not supported (gpt2, llama)")
    _add_whole_tokens(backend, tokens, types)
    return TextTokenizer(backend, tokens, scores, types)


def _byte_level_bpe(tokens: list[str], merges: list[str]) -> object:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    pairs = []
    for merge in merges:
        left, _, right = merge.partition(" ")
        pairs.append((left, right))
    tokenizer = Tokenizer(models.BPE(vocab=_vocab(tokens), merges=pairs))
    digits = pre_tokenizers.Digits(individual_digits=True)
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([digits, byte_level])
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def sentencepiece_merges(tokens: Sequence[str], scores: Sequence[float], types: Sequence[int]) -> list[tuple[str, str]]:
    """Every ``(a, b)`` with ``a``, ``b`` and ``a + b`` pieces, ``a + b`` normal, best-scoring ``a + b`` first."""
    ids = _vocab(tokens)
    ranked: list[tuple[float, int, str, str]] = []
    for token_id, piece in enumerate(tokens):
        if types[token_id] != TOKEN_NORMAL or len(piece) < 2:
            continue
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in ids and right in ids:
                ranked.append((-scores[token_id], token_id, left, right))
    ranked.sort()
    return [(left, right) for _, _, left, right in ranked]


def _sentencepiece_bpe(tokens: list[str], scores: list[float], types: list[int]) -> object:
    from tokenizers import Tokenizer, decoders, models, normalizers

    if len(scores) != len(tokens):
        raise ValueError(f"GGUF has {len(tokens)} tokens but {len(scores)} scores")
    unknown = "<unk>" if "<unk>" in tokens else None
    model = models.BPE(
        vocab=_vocab(tokens),
        merges=sentencepiece_merges(tokens, scores, types),
        unk_token=unknown,
        byte_fallback=True,
        fuse_unk=True,
    )
    tokenizer = Tokenizer(model)
    tokenizer.normalizer = normalizers.Replace(" ", "▁")
    tokenizer.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    return tokenizer


def _add_whole_tokens(backend: object, tokens: list[str], types: list[int]) -> None:
    from tokenizers import AddedToken, Tokenizer

    assert isinstance(backend, Tokenizer)
    control = [AddedToken(t, special=True, normalized=False) for t, k in zip(tokens, types) if k == TOKEN_CONTROL]
    user = [AddedToken(t, special=False, normalized=False) for t, k in zip(tokens, types) if k == TOKEN_USER_DEFINED]
    backend.add_special_tokens(control)
    backend.add_tokens(user)


def _vocab(tokens: Sequence[str]) -> dict[str, int]:
    """Piece -> id; a piece listed twice keeps its first id (as llama.cpp's lookup does)."""
    vocab: dict[str, int] = {}
    for token_id, piece in enumerate(tokens):
        vocab.setdefault(piece, token_id)
    return vocab


def _strings(metadata: Mapping[str, object], key: str) -> list[str]:
    values = metadata.get(key)
    if not isinstance(values, list):
        raise ValueError(f"GGUF metadata {key} is missing or not a list")
    return [str(value) for value in values]


def _ints(metadata: Mapping[str, object], key: str) -> list[int]:
    return [int(value) for value in _strings(metadata, key)]


def _floats(metadata: Mapping[str, object], key: str) -> list[float]:
    return [float(value) for value in _strings(metadata, key)]
