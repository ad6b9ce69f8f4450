"""The FakeEngine's reads and writes of page words, on either backend.

On the cpu backend page views are NumPy arrays and the words are plain indexing. On cuda they are CuPy arrays:
every write and read is a small gather/scatter kernel queued on the cache's stream, the stream the manager's page
moves run on too, so a check reads what landed after every move before it (a read then waits for its stream).
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any, ContextManager, cast

import numpy as np
import numpy.typing as npt

from .._storage.stream_order import cupy_stream

U64 = npt.NDArray[np.uint64]
I64 = npt.NDArray[np.int64]


def _on(view: object, stream: int) -> ContextManager[object]:
    """The cache's stream as CuPy's current one for a device view; nothing for a NumPy view."""
    if isinstance(view, np.ndarray):
        return nullcontext()
    return cast(ContextManager[object], cupy_stream(stream))


def write_records(view: object, rows: I64, columns: I64, values: U64, stream: int) -> None:
    """``words[rows[i], columns[i]] = values[i]``, where ``words`` is the page view as 64-bit words."""
    if isinstance(view, np.ndarray):
        view.view(np.uint64)[rows, columns] = values
        return
    import cupy

    with _on(view, stream):
        words: Any = cast(Any, view).view(cupy.uint64)
        words[cupy.asarray(rows), cupy.asarray(columns)] = cupy.asarray(values)


def read_records(view: object, rows: I64, columns: I64, stream: int) -> U64:
    """``words[rows[i], columns[i]]`` for every ``i``, on the host."""
    if isinstance(view, np.ndarray):
        found: U64 = view.view(np.uint64)[rows, columns]
        return found
    import cupy

    with _on(view, stream):
        words: Any = cast(Any, view).view(cupy.uint64)
        return cast(U64, cupy.asnumpy(words[cupy.asarray(rows), cupy.asarray(columns)]))


def write_state(view: object, row: int, words: tuple[int, int], stream: int) -> None:
    """The first two 64-bit words of page ``row`` (an SSM state's fake summary)."""
    values = np.array(words, dtype=np.uint64)
    if isinstance(view, np.ndarray):
        view[row, :16].view(np.uint64)[:] = values
        return
    import cupy

    with _on(view, stream):
        cast(Any, view)[row, :16].view(cupy.uint64)[:] = cupy.asarray(values)


def read_state(view: object, row: int, stream: int) -> tuple[int, int]:
    """What ``write_state`` wrote to page ``row``."""
    if isinstance(view, np.ndarray):
        words: U64 = view[row, :16].view(np.uint64)
    else:
        import cupy

        with _on(view, stream):
            words = cast(U64, cupy.asnumpy(cast(Any, view)[row, :16].view(cupy.uint64)))
    return int(words[0]), int(words[1])
