"""What a page's bytes mean, which the manager's layout cannot tell: both sides of a NIXL handoff declare it.

The manager knows buffers by their byte sizes only, and the handshake compares those (``same_layout.layout_summary``).
Pages of the same size can still hold other KV: fp16 and bf16 elements, another model's weights (a fine-tune, a
quantization), heads and head dimensions arranged otherwise (8 x 128 or 16 x 64, NHD or HND), another
tensor-parallel rank's heads. A READ copies such pages silently and the decode side computes garbage, so each side
names these in a ``KVFormat`` and the handshake refuses any difference, naming both sides' values.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final, final

from mypy_extensions import mypyc_attr

from .._base.validation import check_tensor_parallel_group, coerce_fields, refuse_subclass

# Spellings of one element type: ``str(torch.bfloat16)``, NumPy's names and the usual short ones compare equal.
_DTYPE_ALIASES: Final = {
    "half": "float16",
    "fp16": "float16",
    "f16": "float16",
    "bf16": "bfloat16",
    "float": "float32",
    "fp32": "float32",
    "f32": "float32",
    "fp8_e4m3": "float8_e4m3fn",
    "e4m3": "float8_e4m3fn",
    "fp8_e5m2": "float8_e5m2",
    "e5m2": "float8_e5m2",
}
_DTYPE_PREFIXES: Final = ("torch.", "numpy.", "np.")


def canonical_dtype(dtype: str) -> str:
    """``dtype`` lower-cased, without a ``torch.``/``numpy.`` prefix, short names spelled out (``bf16`` ->
    ``bfloat16``)."""
    name = dtype.strip().lower()
    for prefix in _DTYPE_PREFIXES:
        if name.startswith(prefix):
            name = name[len(prefix) :]
    return _DTYPE_ALIASES.get(name, name)


@final
@mypyc_attr(native_class=False)
@dataclass(frozen=True)
class KVFormat:
    """How the engine fills its pages, declared by both sides of a NIXL handoff (``KVSender`` / ``KVReceiver``'s
    ``kv_format``) and compared at the handshake, which refuses any difference with a ``ValueError`` naming both
    sides' values (both sides raise).

    ``dtype``: the element type of K/V (``"bfloat16"``, ``"float16"``, ``"float8_e4m3fn"``; ``bf16``, ``fp16``,
    ``str(torch.bfloat16)`` and NumPy's names are accepted and compared as one spelling). ``model``: the weights
    (name and revision, e.g. ``"llama-3.1-8b-instruct@main"``): a fine-tune has the layout of its base. ``page_layout``:
    how the engine arranges a page's bytes beyond their size, e.g. ``"NHD 8x128"`` (heads x head dimension, token-major);
    empty when one arrangement is all the engine has. ``tensor_parallel_rank`` and ``tensor_parallel_size``: the heads
    this instance holds, its rank in a group of that size; a decode rank must read the prefill rank holding the same
    heads, and with more ranks than KV heads rank r of a group of 16 holds another head than rank r of a group of 8.
    """

    dtype: str
    model: str
    page_layout: str = ""
    tensor_parallel_rank: int = 0
    tensor_parallel_size: int = 1

    @classmethod
    def __init_subclass__(cls) -> None:
        refuse_subclass(cls, "KVFormat")

    def __post_init__(self) -> None:
        ints = ("tensor_parallel_rank", "tensor_parallel_size")
        coerce_fields(self, ints=ints, strs=("dtype", "model", "page_layout"))
        dtype = canonical_dtype(self.dtype)
        if not dtype:
            raise ValueError(f"KVFormat.dtype must name the KV element type (e.g. 'bfloat16'), got {self.dtype!r}")
        self.__dict__["dtype"] = dtype
        if not self.model.strip():
            raise ValueError(
                f"KVFormat.model must name the model's weights (e.g. 'llama-3.1-8b-instruct@main'), got {self.model!r}:"
                " a fine-tune has its base's layout and other KV"
            )
        check_tensor_parallel_group(self.tensor_parallel_rank, self.tensor_parallel_size, "KVFormat")

    def summary(self) -> tuple[tuple[str, str], ...]:
        """The entries the handshake compares, after the manager's ``layout_summary``."""
        return (
            ("KV dtype", self.dtype),
            ("model", self.model),
            ("page layout", repr(self.page_layout)),
            ("tensor-parallel rank", str(self.tensor_parallel_rank)),
            ("tensor-parallel size", str(self.tensor_parallel_size)),
        )
