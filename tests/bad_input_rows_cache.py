"""Bad input to a ``KVCache`` (``tests/test_bad_inputs.py`` runs the rows): lengths and setters, commit, page
tables, resume, calls needing another state, every call on a closed cache."""

from __future__ import annotations

import numpy as np

from tests.bad_input_world import Bad, read_only_table, resize_with_priority

CACHE_ROWS: list[Bad] = [
    # --- cache: resize and the length setters
    Bad("resize: negative capacity", lambda w: w.active.resize(-1), ValueError, "capacity"),
    Bad("resize: float capacity", lambda w: w.active.resize(100.0), TypeError, "capacity"),  # type: ignore[arg-type]
    Bad(
        "resize: numpy float capacity",
        lambda w: w.active.resize(np.float64(100)),  # type: ignore[arg-type]
        TypeError,
        "capacity",
    ),
    Bad("resize: str capacity", lambda w: w.active.resize("100"), TypeError, "capacity"),  # type: ignore[arg-type]
    Bad("resize: capacity None", lambda w: w.active.resize(None), TypeError, "capacity"),  # type: ignore[arg-type]
    Bad("resize: bool history", lambda w: w.active.resize(90, True), TypeError, "history_length"),
    Bad("resize: history moves backwards", lambda w: w.active.resize(90, 69), ValueError, "history_length 69"),
    Bad("resize: history beyond capacity", lambda w: w.active.resize(90, 91), ValueError, "history_length 91"),
    Bad("resize: capacity below history", lambda w: w.active.resize(60), ValueError, "capacity 60"),
    Bad("resize: grows past a registered page table", lambda w: w.stopped.resize(80), ValueError, "buffer"),
    Bad("capacity setter: negative", lambda w: setattr(w.active, "capacity", -5), ValueError, "capacity"),
    Bad("capacity setter: float", lambda w: setattr(w.active, "capacity", 95.0), TypeError, "capacity"),
    Bad(
        "history setter: backwards",
        lambda w: setattr(w.active, "history_length", 10),
        ValueError,
        "history_length 10",
    ),
    Bad("history setter: str", lambda w: setattr(w.active, "history_length", "80"), TypeError, "history_length"),
    Bad(
        "resize: priority callback returns 101",
        lambda w: resize_with_priority(w, 101),
        ValueError,
        "custom_priority_callback",
    ),
    Bad(
        "resize: priority callback returns a float",
        lambda w: resize_with_priority(w, 5.5),
        TypeError,
        "custom_priority_callback|int object",
    ),
    # --- cache: commit
    Bad("commit: beyond capacity", lambda w: w.active.commit(list(range(21))), ValueError, "capacity 90"),
    Bad("commit: tokens is a str", lambda w: w.active.commit("abc"), TypeError, "tokens"),  # type: ignore[arg-type]
    Bad("commit: float token", lambda w: w.active.commit([1.0]), TypeError, r"tokens\[0\]"),  # type: ignore[list-item]
    Bad("commit: numpy float tokens", lambda w: w.active.commit(np.array([1.0, 2.0])), TypeError, r"tokens\[0\]"),
    Bad("commit: tokens None", lambda w: w.active.commit(None), TypeError, "tokens"),  # type: ignore[arg-type]
    Bad("commit after stop_committing", lambda w: w.stopped.commit([1]), ValueError, "stop_committing"),
    # --- cache: page tables
    Bad("indices: unknown layer group", lambda w: w.active.get_base_page_indices(9), ValueError, "layer_group_id 9"),
    Bad(
        "SSM slot of an attention layer group", lambda w: w.active.get_ssm_block_base_index(0), ValueError,
        "layer_group_id 0 is not an SSM layer group",
    ),
    Bad("indices: beam 1", lambda w: w.active.get_base_page_indices(0, 1), ValueError, "beam_id 1"),
    Bad(
        "indices: str layer group",
        lambda w: w.active.get_base_page_indices("0"),  # type: ignore[arg-type]
        TypeError,
        "layer_group_id",
    ),
    Bad(
        "table: too short",
        lambda w: w.active.set_base_page_index_buf(0, 0, np.zeros(2, np.int32)),
        ValueError,
        r"len\(buf\) is 2, fewer than num_blocks [3-9]",  # the argument and its length, not "2 entries" of "1 entries"
    ),
    Bad("table: int64", lambda w: w.active.set_base_page_index_buf(0, 0, np.zeros(16, np.int64)), ValueError, "int32"),
    Bad(
        "table: 2-D",
        lambda w: w.active.set_base_page_index_buf(0, 0, np.zeros((4, 16), np.int32)),
        ValueError,
        "ndim|1-D",
    ),
    Bad(
        "table: read-only",
        lambda w: w.active.set_base_page_index_buf(0, 0, read_only_table()),
        ValueError,
        "writable",
    ),
    Bad("table: bytes object", lambda w: w.active.set_base_page_index_buf(0, 0, bytes(64)), ValueError, "writable"),
    Bad("table: not a buffer", lambda w: w.active.set_base_page_index_buf(0, 0, 5), TypeError, "buf"),  # type: ignore[arg-type]
    Bad(
        "table: unknown layer group",
        lambda w: w.active.set_base_page_index_buf(0, 5, np.zeros(16, np.int32)),
        ValueError,
        "layer_group_id 5",
    ),
    Bad(
        "table: beam 1",
        lambda w: w.active.set_base_page_index_buf(1, 0, np.zeros(16, np.int32)),
        ValueError,
        "beam_idx 1",
    ),
    Bad(
        "table: non-contiguous",
        lambda w: w.active.set_base_page_index_buf(0, 0, np.zeros(32, np.int32)[::2]),
        ValueError,
        "buf",
    ),
    # --- cache: resume
    Bad(
        "resume: str stream",
        lambda w: w.suspended.resume("stream"),  # type: ignore[arg-type]
        TypeError,
        "cuda_stream",
    ),
    Bad("resume: float stream", lambda w: w.active.resume(1.5), TypeError, "cuda_stream"),  # type: ignore[arg-type]
    # --- operations needing an active cache, on a suspended one
    Bad("suspended: resize", lambda w: w.suspended.resize(120), ValueError, "suspended"),
    Bad("suspended: commit", lambda w: w.suspended.commit([1]), ValueError, "suspended"),
    Bad("suspended: capacity setter", lambda w: setattr(w.suspended, "capacity", 120), ValueError, "suspended"),
    Bad("suspended: history setter", lambda w: setattr(w.suspended, "history_length", 100), ValueError, "suspended"),
    # --- every operation on a closed cache
    Bad("closed: resume", lambda w: w.closed.resume(), ValueError, "closed"),
    Bad("closed: suspend", lambda w: w.closed.suspend(), ValueError, "closed"),
    Bad("closed: resize", lambda w: w.closed.resize(96), ValueError, "closed"),
    Bad("closed: commit", lambda w: w.closed.commit([1]), ValueError, "closed"),
    Bad("closed: stop_committing", lambda w: w.closed.stop_committing(), ValueError, "closed"),
    Bad("closed: capacity setter", lambda w: setattr(w.closed, "capacity", 96), ValueError, "closed"),
    Bad("closed: history setter", lambda w: setattr(w.closed, "history_length", 80), ValueError, "closed"),
    Bad(
        "closed: set_base_page_index_buf",
        lambda w: w.closed.set_base_page_index_buf(0, 0, np.zeros(16, np.int32)),
        ValueError,
        "closed",
    ),
    Bad(
        "closed: get_base_page_indices",
        lambda w: w.closed.get_base_page_indices(0),
        ValueError,
        "closed",
    ),
    # the engine's other address reads: a closed cache has no pages, so an answer (0, None, -1) would be read as one
    Bad("closed: get_num_front_blocks_removed", lambda w: w.closed.get_num_front_blocks_removed(1), ValueError, "closed"),
    Bad("closed: get_scratch_desc", lambda w: w.closed.get_scratch_desc(0), ValueError, "closed"),
    Bad("closed: get_ssm_block_base_index", lambda w: w.closed.get_ssm_block_base_index(0), ValueError, "closed"),
]
