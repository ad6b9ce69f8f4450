"""The type of ``KVCacheManager.get_page_view``'s answer.

The array is NumPy on the cpu backend and CuPy on cuda, and the backend is a runtime choice, so no overload can
pick one. What both offer, and what an engine needs to hand the pages to its own framework without a copy, is
the shape and the DLPack export (``torch.from_dlpack``, ``numpy.from_dlpack``, ``cupy.from_dlpack``); this
Protocol names exactly that, so a strict downstream checker accepts those calls without a cast.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from mypy_extensions import mypyc_attr

if TYPE_CHECKING:
    from typing_extensions import CapsuleType


@mypyc_attr(native_class=False)
class PageView(Protocol):
    """A 2-D ``uint8`` array of GPU-tier pages (row ``i`` is page index ``i``): NumPy on cpu, CuPy on cuda."""

    @property
    def shape(self) -> tuple[int, ...]:
        """``(upper_bound, stride)``: one row per page index, ``stride`` bytes each."""
        raise NotImplementedError

    def __dlpack__(self, /, *, stream: int | None = None) -> CapsuleType:
        """The DLPack capsule (``stream``: the consumer's CUDA stream on cuda, ``None`` on cpu)."""
        raise NotImplementedError

    def __dlpack_device__(self, /) -> tuple[int, int]:
        """DLPack's (device type, device id): (1, 0) for host memory, (2, n) for CUDA device ``n``."""
        raise NotImplementedError
