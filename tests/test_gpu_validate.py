"""``tools/gpu_validate.py`` is the whole check a lent GPU runs: its test part must reach every test marked ``gpu``,
wherever a refactor puts it (a list of files missed the one ``test_disagg_safety.py`` took over)."""

from __future__ import annotations

import re
from pathlib import Path

from tools.gpu_validate import GPU_TESTS_COMMAND

TESTS = Path(__file__).resolve().parent
GPU_MARK = re.compile(r"\bpytest\.mark\.gpu\b")


def test_gpu_validate_selects_every_test_file_with_a_gpu_mark() -> None:
    marked = {path.relative_to(TESTS.parent).as_posix() for path in TESTS.rglob("test_*.py")
              if GPU_MARK.search(path.read_text(encoding="utf-8"))}
    assert "tests/test_disagg_safety.py" in marked and len(marked) > 5
    command = " ".join(GPU_TESTS_COMMAND)
    assert "-m gpu" in command
    named = {argument for argument in GPU_TESTS_COMMAND if argument.endswith(".py") or argument.startswith("tests")}
    assert not named or marked <= named, sorted(marked - named)
