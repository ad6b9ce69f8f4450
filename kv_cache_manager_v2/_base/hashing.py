"""Block keys for prefix reuse: chained SHA-256 over a reuse scope and each block's tokens."""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass
from typing import Any, Final, Iterator, Sequence, SupportsIndex, Union

import numpy as np
import numpy.typing as npt
from mypy_extensions import mypyc_attr

from .validation import as_int, coerce_fields

# A token is a vocabulary id or an opaque multimodal digest.
Token = Union[int, bytes]
# TensorRT-LLM's name for a token: an id, or a multimodal item's digest standing in for one.
TokenIdExt = Token
# What the API takes as tokens: a sequence of them (list, tuple, array('q'), range) or a 1-D NumPy integer array.
# A str is rejected by the type checker; bytes (a Sequence[int] to it) only at run time.
TokenSequence = Union[Sequence[Token], "npt.NDArray[np.integer[Any]]"]

_LENGTH: Final = struct.Struct("<I")


@mypyc_attr(native_class=False)
@dataclass(frozen=True)
class ReuseScope:
    """Requests share cached blocks only within one scope; ``lora_id=None`` and ``lora_id=0`` differ.

    Non-native (like the config classes) so construction can check both fields and turn NumPy integers into
    ``int`` before a bad value reaches the hashing.
    """

    lora_id: int | None = None
    salt: int | bytes | str | None = None

    def __post_init__(self) -> None:
        coerce_fields(self, optional_ids=("lora_id",))
        salt: object = self.__dict__["salt"]
        # A str or bytes subclass becomes the plain value: its methods (encode, hash) would run inside manager calls.
        if isinstance(salt, str):
            if type(salt) is not str:
                self.__dict__["salt"] = salt = str.__str__(salt)
            try:
                salt.encode()  # the scope's key holds its UTF-8 bytes: a lone surrogate has none
            except UnicodeEncodeError as error:
                raise ValueError(f"ReuseScope.salt must be encodable as UTF-8, got {salt!r}: {error.reason}") from None
        elif isinstance(salt, bytes) and type(salt) is not bytes:
            self.__dict__["salt"] = b"".join((salt,))
        elif salt is not None and not isinstance(salt, (bytes, str)):
            try:
                self.__dict__["salt"] = as_int(salt, "ReuseScope.salt")
            except TypeError:
                raise TypeError(
                    f"ReuseScope.salt must be an int, bytes, str or None, got {type(salt).__name__} {salt!r}"
                ) from None

    def __reduce__(self) -> tuple[type[ReuseScope], tuple[int | None, int | bytes | str | None]]:
        return (ReuseScope, (self.lora_id, self.salt))


def _encode_optional(value: int | bytes | str | None) -> bytes:
    if value is None:
        return b"n"
    if isinstance(value, bool):
        raise TypeError(f"scope values must be int, bytes or str, got bool {value!r}")
    if isinstance(value, int):
        return b"i" + str(value).encode()
    if isinstance(value, bytes):
        return b"b" + _LENGTH.pack(len(value)) + value
    return b"s" + value.encode()


def check_scope(value: object, name: str = "reuse_scope") -> ReuseScope | None:
    """``value`` if it is a ``ReuseScope`` or None, else a ``TypeError`` naming ``name``; for a sequence it says
    where tokens go, since ``reuse_scope`` is the first parameter of the calls taking both (TensorRT-LLM's order)."""
    if value is None or isinstance(value, ReuseScope):
        return value
    hint = ""
    if hasattr(value, "__len__") and not isinstance(value, (str, bytes)):
        hint = ": tokens go in input_tokens (reuse_scope comes first: pass input_tokens=... by keyword)"
    raise TypeError(f"{name} must be a ReuseScope or None, got {value!r}{hint}")


def root_key(scope: ReuseScope | None) -> bytes:
    """Key of the tree root of a scope (``None`` means the default scope ``ReuseScope()``)."""
    if scope is None:
        return DEFAULT_ROOT_KEY
    return _scope_key(scope)


def _scope_key(scope: ReuseScope) -> bytes:
    digest = hashlib.sha256(b"kv_cache_manager_v2/root/")
    digest.update(_encode_optional(scope.lora_id))
    digest.update(b"/")
    digest.update(_encode_optional(scope.salt))
    return digest.digest()


# Every probe and admission asks for the default scope's root: its key is computed once.
DEFAULT_ROOT_KEY: Final = _scope_key(ReuseScope())


def encode_tokens(tokens: Sequence[Token]) -> bytes:
    """Canonical bytes of a block's tokens; all-int blocks take a packed fast path with a distinct tag, packed by
    a ``struct`` of their length (the bytes of ``array("q")``, twice as fast to make)."""
    try:
        return b"I" + _int_packer(len(tokens)).pack(*tokens)
    except struct.error:
        pass
    parts: list[bytes] = [b"M"]
    for token in tokens:
        if isinstance(token, bytes):
            parts.append(b"b" + _LENGTH.pack(len(token)) + token)
        else:
            parts.append(b"i" + str(token).encode() + b";")
    return b"".join(parts)


def block_key(parent_key: bytes, tokens: Sequence[Token]) -> bytes:
    """hash(previous key, block tokens): equal scope and equal token prefix give equal keys."""
    return hashlib.sha256(parent_key + encode_tokens(tokens)).digest()


# Packers of all-int blocks by length (at most ``tokens_per_block`` of them: full blocks and the partial lengths).
_INT_PACKERS: Final[dict[int, struct.Struct]] = {}


def _int_packer(count: int) -> struct.Struct:
    packer = _INT_PACKERS.get(count)
    if packer is None:
        packer = struct.Struct(f"={count}q")  # native order, 8 bytes each: what array("q").tobytes() gives
        _INT_PACKERS[count] = packer
    return packer


_PLAIN_INTS: Final = {int}
# Whether this module runs compiled: the plain-int check of every prompt token picks the faster form per mode.
_COMPILED: Final = not __file__.endswith(".py")


def _all_plain_ints(items: list[object]) -> bool:
    """Whether every item is exactly an ``int`` (the common case). Compiled, the loop is C (~2 ns a token);
    interpreted, ``set(map(type, ...))`` runs in C too and beats the loop by about 2x (measured, 2,048 tokens)."""
    if not _COMPILED:
        return set(map(type, items)) == _PLAIN_INTS
    for item in items:
        if type(item) is not int:
            return False
    return True


def check_tokens(tokens: object, name: str) -> list[Token]:
    """Tokens as a list of ints and bytes (NumPy integers and 1-D integer arrays accepted); TypeError naming
    ``name`` otherwise. Plain ints take the first test: this runs on every request's whole prompt. A list of plain
    ints comes back as it is, not copied: callers read it and keep slices of it only (a kept list is copied). Any
    other iterable, a ``list`` subclass included, is read once into a new list: its own ``__iter__``,
    ``__getitem__`` or ``__len__`` never runs again inside the call."""
    if type(tokens) is list:
        items: list[object] = tokens
    else:
        if isinstance(tokens, (str, bytes)):
            raise TypeError(f"{name} must be a sequence of tokens, got {type(tokens).__name__}")
        ndim: object = getattr(tokens, "ndim", 1)
        if ndim != 1:
            raise TypeError(f"{name} must be a 1-D sequence of tokens, got a {ndim}-D {type(tokens).__name__}")
        if type(tokens) is np.ndarray and tokens.dtype.kind in "iu":
            # NumPy's own conversion to plain ints, in C: iterating makes a NumPy scalar per token, and converting
            # each one took ~600 ns a token (an 8k-token prompt: ~5 ms a ``probe_reuse``, every waiting request).
            items = tokens.tolist()
        else:
            try:
                items = list(tokens)  # type: ignore[call-overload]
            except TypeError:
                raise TypeError(f"{name} must be a sequence of int or bytes tokens, got {tokens!r}") from None
    if _all_plain_ints(items):
        return items  # type: ignore[return-value]
    result: list[Token] = []
    for position, token in enumerate(items):
        if type(token) is int or type(token) is bytes or type(token) is MultimodalDigest:
            result.append(token)
            continue
        if isinstance(token, bytes):
            result.append(_plain_bytes_token(token, name, position))
            continue
        if isinstance(token, (bool, np.bool_)) or not hasattr(token, "__index__"):  # NumPy < 2.3: bool_ has one
            raise TypeError(f"{name}[{position}] must be an int or bytes token, got {token!r}")
        result.append(int(token.__index__()))
    return result


def check_text_only(tokens: Sequence[Token], name: str) -> None:
    """A text-only cache's tokens (``text_only``): ValueError naming the first multimodal (bytes) one. Every path
    tokens enter a text-only cache by (``create_kv_cache``, a batch request, ``commit``) runs this one check."""
    for position, token in enumerate(tokens):
        if isinstance(token, bytes):
            raise ValueError(f"{name}[{position}] is a multimodal token but text_only is set")


def _plain_bytes_token(token: bytes, name: str, position: int) -> bytes:
    """A bytes token of a subclass as the manager's own value (``bytes``, or a ``MultimodalDigest`` with its uuid):
    the subclass's methods (``__hash__``, ``__eq__``) would otherwise run inside manager calls, half way through
    changing the tree."""
    data = b"".join((token,))  # the buffer's bytes, no method of the subclass
    # Not isinstance: compiled, mypyc tests a class with no subclass of its own by exact type.
    if MultimodalDigest not in type(token).__mro__:
        return data
    uuid: object = getattr(token, "uuid", None)
    if uuid is not None and not isinstance(uuid, str):
        raise TypeError(f"{name}[{position}].uuid must be a str or None, got {uuid!r}")
    digest = MultimodalDigest(data)
    digest.uuid = None if uuid is None else str.__str__(uuid)
    return digest


MULTIMODAL_DIGEST_BYTES: Final = 32
# Most stand-in tokens of one multimodal item: checked before the list is built (num_tokens=2**63 grew it until
# memory ran out); no model's item comes near 16.8 million tokens.
MAX_MULTIMODAL_ITEM_TOKENS: Final = 1 << 24


@mypyc_attr(native_class=False)
class MultimodalDigest(bytes):
    """The digest token of a multimodal item, carrying the item's ``uuid`` for KV events; it hashes as its bytes,
    so the uuid never changes a block key."""

    uuid: str | None = None


def gen_multimodal_cache_key_tokens(
    id_offset: SupportsIndex,
    multi_modal_data_digest: bytes,
    num_tokens: SupportsIndex,
    token_offset: SupportsIndex = 0,
    uuid: str | None = None,
) -> list[Token]:
    """Stand-in tokens for positions ``token_offset .. token_offset + num_tokens - 1`` of a multimodal item.

    Item position 0 is the 32-byte digest (carrying ``uuid``), position ``p > 0`` is ``id_offset + p``: two items
    share cache blocks only when their digests (and positions) match, and ids past the vocabulary never collide
    with text tokens. ``token_offset`` lets a chunked prefill generate the item piece by piece.
    """
    offset = as_int(id_offset, "id_offset")
    count = as_int(num_tokens, "num_tokens")
    start = as_int(token_offset, "token_offset")
    if not isinstance(multi_modal_data_digest, bytes):
        raise TypeError(f"multi_modal_data_digest must be bytes, got {type(multi_modal_data_digest).__name__}")
    if len(multi_modal_data_digest) != MULTIMODAL_DIGEST_BYTES:
        raise ValueError(
            f"multi_modal_data_digest must be {MULTIMODAL_DIGEST_BYTES} bytes (e.g. a SHA-256 digest), got "
            f"{len(multi_modal_data_digest)}"
        )
    if count <= 0:
        raise ValueError(f"num_tokens must be > 0, got {count}")
    if count > MAX_MULTIMODAL_ITEM_TOKENS:
        raise ValueError(f"num_tokens must be <= {MAX_MULTIMODAL_ITEM_TOKENS} (one multimodal item), got {count}")
    if start < 0:
        raise ValueError(f"token_offset must be >= 0, got {start}")
    if offset < 0:
        raise ValueError(f"id_offset must be >= 0, got {offset}")
    if uuid is not None and not isinstance(uuid, str):
        raise TypeError(f"uuid must be a str or None, got {type(uuid).__name__}")
    result: list[Token] = []
    if start == 0:
        digest = MultimodalDigest(multi_modal_data_digest)
        digest.uuid = uuid
        result.append(digest)
    result.extend(range(offset + max(start, 1), offset + start + count))
    return result


def sequence_to_blockchain_keys(
    tokens_per_block: SupportsIndex, reuse_scope: ReuseScope | None, tokens: TokenSequence
) -> Iterator[tuple[list[Token], bytes]]:
    """Each block of ``tokens`` with its chained key, as the radix tree keys it (a trailing partial block too):
    a router can compute the keys a manager would publish without asking it."""
    tpb = as_int(tokens_per_block, "tokens_per_block")
    if tpb <= 0:
        raise ValueError(f"tokens_per_block must be > 0, got {tpb}")
    check_scope(reuse_scope)
    checked = check_tokens(tokens, "tokens")
    key = root_key(reuse_scope)
    for begin in range(0, len(checked), tpb):
        block = checked[begin : begin + tpb]
        key = block_key(key, block)
        yield block, key
