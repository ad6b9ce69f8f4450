"""Cold-page codecs: how a tier after the first stores a layer group's pages in another (encoded) form.

A manager built with ``cold_page_codec`` keeps its first tier (the hot GPU tier) as plain pages and every later
tier ("cold" tiers, a second GPU tier typically) as encoded pages. The codec declares, per layer group, how many
bytes one encoded page takes; the layout then groups layer groups per tier by the page size they have there
(``_model/tier_grouping.py``), so a cold tier may merge layer groups the hot tier keeps apart or split ones it
shares. A move between the hot tier and a cold one runs per layer group slot: the hot slot's pools are gathered
into one plain page, encoded into the cold slot (offload), or the cold slot is decoded and scattered back
(onboard). Moves between two cold tiers copy the encoded bytes as they are. Offload / onboard statistics count
encoded bytes.

A codec works on 2-D ``uint8`` arrays, one row per page, NumPy on the cpu backend and CuPy on cuda: whatever
slicing and assignment both libraries share. ``decode(encode(page))`` must give back the page's exact bytes.
"""

from __future__ import annotations

from typing import Mapping, Protocol, SupportsIndex

from mypy_extensions import mypyc_attr

from .._base.validation import as_int


@mypyc_attr(native_class=False)
class ColdPageCodec(Protocol):
    """What a manager needs of a codec (``KVCacheManager(config, cold_page_codec=...)``)."""

    def encoded_page_bytes(self, layer_group_id: int) -> int:
        """Bytes of one encoded page of ``layer_group_id`` (a block of all its buffers); must be positive."""
        raise NotImplementedError

    def encode(self, layer_group_id: int, pages: object, encoded: object) -> None:
        """Write the encoded form of each row of ``pages`` (plain page bytes) into the same row of ``encoded``."""
        ...

    def decode(self, layer_group_id: int, encoded: object, pages: object) -> None:
        """Write back into each row of ``pages`` the plain bytes that the same row of ``encoded`` holds."""
        ...


@mypyc_attr(allow_interpreted_subclasses=True)
class PaddingColdPageCodec:
    """Test codec: an encoded page is the plain page followed by zero bytes up to the declared size. It makes
    cold pages a different size from hot ones, which is all the per-tier grouping needs to be exercised (tests
    derive codecs that also transform the bytes, hence interpreted subclasses)."""

    def __init__(self, encoded_bytes: Mapping[int, SupportsIndex]) -> None:
        if not isinstance(encoded_bytes, Mapping):
            raise TypeError(f"encoded_bytes must be a mapping of layer group id to bytes, got {encoded_bytes!r}")
        sizes: dict[int, int] = {}
        for key, value in encoded_bytes.items():
            layer_group = as_int(key, "encoded_bytes key")
            size = as_int(value, f"encoded_bytes[{layer_group}]")
            if size <= 0:
                raise ValueError(f"encoded_bytes[{layer_group}] must be positive, got {size}")
            sizes[layer_group] = size
        self._sizes = sizes

    def encoded_page_bytes(self, layer_group_id: int) -> int:
        size = self._sizes.get(layer_group_id)
        if size is None:
            raise ValueError(f"cold_page_codec declares no encoded size for layer group {layer_group_id}")
        return size

    def encode(self, layer_group_id: int, pages: object, encoded: object) -> None:
        width = _width(pages)
        if width > self.encoded_page_bytes(layer_group_id):
            raise ValueError(
                f"a page of layer group {layer_group_id} has {width} bytes, more than the "
                f"{self.encoded_page_bytes(layer_group_id)} its padded form holds"
            )
        encoded[:, :width] = pages  # type: ignore[index]
        encoded[:, width:] = 0  # type: ignore[index]

    def decode(self, layer_group_id: int, encoded: object, pages: object) -> None:
        pages[:, :] = encoded[:, : _width(pages)]  # type: ignore[index]


def _width(rows: object) -> int:
    shape: tuple[int, ...] = rows.shape  # type: ignore[attr-defined]
    return shape[1]
