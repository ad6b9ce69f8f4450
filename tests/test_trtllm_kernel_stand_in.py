"""The conformance runner's CPU stand-in for TensorRT-LLM's test kernels (``tools/trtllm_shims/kernels.py``) still
checks every word it wrote: a page with one wrong word, in any head, record or slot, fails the check."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest

STAND_IN = Path(__file__).resolve().parent.parent / "tools" / "trtllm_shims" / "kernels.py"
HEADS, SLOTS, RECORDS = 2, 8, 3  # records of 16 bytes per (head, token slot)
BYTES_PER_HEAD = RECORDS * 16


@pytest.fixture(scope="module")
def kernels() -> ModuleType:
    spec = importlib.util.spec_from_file_location("trtllm_kernel_stand_in", STAND_IN)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def filled_page(kernels: ModuleType, tokens: list[object]) -> np.ndarray:
    """``(heads, slots, records, 4)`` uint32 page holding ``tokens`` of layer 5, buffer 1, beam 0 (two fills)."""
    page = np.zeros((HEADS, SLOTS, RECORDS, 4), dtype=np.uint32)
    address = page.ctypes.data
    kernels.fill_values(address, BYTES_PER_HEAD, HEADS, SLOTS, 5, 1, 0, tokens[:2], 0)
    kernels.fill_values(address + 2 * BYTES_PER_HEAD, BYTES_PER_HEAD, HEADS, SLOTS, 5, 1, 0, tokens[2:], 0)
    return page


def check(kernels: ModuleType, page: np.ndarray, tokens: list[object], layer: int = 5) -> None:
    kernels.check_values(page.ctypes.data, BYTES_PER_HEAD, HEADS, SLOTS, layer, 1, 0, tokens, 0)


def test_fill_writes_each_record_of_each_head_and_nothing_past_the_tokens(kernels: ModuleType) -> None:
    tokens: list[object] = [7, 2**32 + 9, 11, b"\x01\x02\x03\x04" + bytes(28)]
    page = filled_page(kernels, tokens)
    expected_tokens = [7, 9, 11, 0x04030201]
    for head in range(HEADS):
        for slot, word in enumerate(expected_tokens):
            assert page[head, slot].tolist() == [[word, 5, 1, 0]] * RECORDS
    assert not page[:, len(tokens):].any()
    check(kernels, page, tokens)


@pytest.mark.parametrize("word", range(4))
@pytest.mark.parametrize(("head", "slot", "record"), [(0, 0, 0), (1, 3, 2), (0, 2, 1)])
def test_one_wrong_word_anywhere_fails_the_check(
    kernels: ModuleType, word: int, head: int, slot: int, record: int
) -> None:
    tokens: list[object] = [10, 11, 12, 13]
    page = filled_page(kernels, tokens)
    check(kernels, page, tokens)  # kept expectations must not hide the corruption below
    page[head, slot, record, word] ^= 1 << 20
    with pytest.raises(AssertionError, match=f"token slot {slot} holds other data"):
        check(kernels, page, tokens)


def test_other_tokens_or_another_layer_fail_the_check(kernels: ModuleType) -> None:
    tokens: list[object] = [10, 11, 12, 13]
    page = filled_page(kernels, tokens)
    with pytest.raises(AssertionError, match="token slot 2"):
        check(kernels, page, [10, 11, 99, 13])
    with pytest.raises(AssertionError, match="layer 6 buffer 1: token slot 0"):
        check(kernels, page, tokens, layer=6)
    check(kernels, page, tokens[:3])  # a shorter history checks only its own slots


@pytest.mark.parametrize(("head", "slot", "word"), [(0, 0, 0), (1, SLOTS - 1, 3), (1, 4, 2)])
def test_a_full_page_is_checked_in_one_read_and_still_finds_one_wrong_word(
    kernels: ModuleType, head: int, slot: int, word: int
) -> None:
    tokens: list[object] = list(range(100, 100 + SLOTS))
    page = filled_page(kernels, tokens)
    check(kernels, page, tokens)
    page[head, slot, RECORDS - 1, word] ^= 1
    with pytest.raises(AssertionError, match=f"token slot {slot} holds other data"):
        check(kernels, page, tokens)


@pytest.mark.parametrize(
    "tokens",
    [[-1, 0, 2**32 - 1, 2**32 + 9], [2**63 - 1, 5, 6, 7], [2**63, 5, 6, 7], [3, 4, b"\xff" * 32, 2**70 + 1]],
    ids=["int64", "int64-max", "past-int64", "with-bytes"],
)
def test_expected_records_take_the_low_word_of_any_token(kernels: ModuleType, tokens: list[object]) -> None:
    """The check builds its expected words in one C loop when every token is an int64 and one by one otherwise:
    both must read the low 32 bits that ``fill_values`` wrote, so the same page passes and a changed token fails."""
    page = filled_page(kernels, tokens)
    check(kernels, page, tokens)
    changed = [*tokens[:3], 2**32 + 8]
    with pytest.raises(AssertionError, match="token slot 3 holds other data"):
        check(kernels, page, changed)
