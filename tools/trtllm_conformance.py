"""Run TensorRT-LLM's own KVCacheManagerV2 unit tests against this package and count what passes.

Upstream's files are not shipped here (their code is theirs). Fetch, per era, into a folder of its own:
``tests/unittest/kv_cache_manager_v2_tests/test_kv_cache_manager_v2.py`` and ``fake_engine.py`` beside it, e.g.
NVIDIA/TensorRT-LLM@00043967 (the newest, C++-backed era) and nv-guomingz/TensorRT-LLM@2abc950f (the last
pure-Python era; its own ``fake_engine.py`` is not public in that fork). Use the newest ``fake_engine.py`` you can
get: the one the search index holds (NVIDIA/TensorRT-LLM@4097b146) is older than the 00043967 test file, takes no
head count and reads upstream's private ``manager._storage``, so every test its engine checks fails here. Leave upstream's ``cuda_test_utils.py`` and ``kernels.py`` out: ``tools/trtllm_shims`` holds CPU
stand-ins for them, and its ``aliases`` plugin maps upstream's import paths to ``kv_cache_manager_v2``. The tests
need ``parameterized`` (``pip install parameterized``)::

    python tools/trtllm_conformance.py /work/conformance/newest /work/conformance/older

``--compiled`` imports the mypyc build in ``build/compiled`` instead of the sources (production mode).

Each era's file runs, unchanged, in its own pytest subprocess (this checkout first on ``sys.path``); the script
prints passed / failed / error / skipped counts per era and the failures grouped by cause (exception type and the
first line of its message).
"""

from __future__ import annotations

import argparse
import collections
import os
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ElementTree
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SHIMS = ROOT / "tools" / "trtllm_shims"
COMPILED_BUILD = ROOT / "build" / "compiled"
TEST_FILE = "test_kv_cache_manager_v2.py"


@dataclass
class EraResult:
    """One era's outcome: counts by status and the failing tests by cause."""

    name: str
    counts: collections.Counter[str] = field(default_factory=collections.Counter)
    causes: dict[str, list[str]] = field(default_factory=lambda: collections.defaultdict(list))


def first_line(element: ElementTree.Element) -> str:
    text = element.get("message") or element.text or ""
    line = text.strip().splitlines()[0] if text.strip() else element.get("type", "?")
    return line[:160]


def run_era(
    folder: Path, timeout: float, keyword: str | None, log: Path | None, per_test: float | None, keep: Path | None,
    compiled: bool = False,
) -> EraResult:
    """Run one era's test file in a subprocess and read its JUnit report; ``compiled``: import the package from
    ``build/compiled`` (production mode) instead of the sources."""
    if not (folder / TEST_FILE).is_file() or not (folder / "fake_engine.py").is_file():
        raise SystemExit(f"{folder}: needs {TEST_FILE} and fake_engine.py (see this script's docstring)")
    package_paths = [str(ROOT)]
    if compiled:
        if not COMPILED_BUILD.is_dir():
            raise SystemExit(f"--compiled needs {COMPILED_BUILD} (python setup_mypyc.py build --build-lib build/compiled)")
        package_paths.insert(0, str(COMPILED_BUILD))
    result = EraResult(folder.name)
    with tempfile.TemporaryDirectory() as scratch:
        report = Path(scratch) / "report.xml"
        command = [sys.executable, "-m", "pytest", str(folder / TEST_FILE), "-p", "aliases", "-q",
                   "-p", "no:cacheprovider", f"--junitxml={report}", "-o", "junit_family=xunit1"]
        if keyword:
            command += ["-k", keyword]
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(SHIMS), *package_paths, os.environ.get("PYTHONPATH", "")]))
        if log is not None:
            command.append("-v")
        if per_test is not None:
            command.append(f"--timeout={per_test}")  # needs pytest-timeout
        with open(log or os.devnull, "a") as output:
            subprocess.run(command, cwd=scratch, env=env, timeout=timeout, stdout=output, stderr=output, check=False)
        if not report.is_file():
            raise SystemExit(f"{folder}: pytest wrote no report (run the command by hand: {' '.join(command)})")
        if keep is not None:
            keep.mkdir(parents=True, exist_ok=True)
            (keep / f"{folder.name}.xml").write_bytes(report.read_bytes())
        read_report(report, result)
    return result


def read_report(report: Path, result: EraResult) -> None:
    """Count each test once: a teardown error after a failure (the same test twice in the report) stays a failure,
    and a test whose teardown errors after its body passed did not pass."""
    outcomes: dict[str, tuple[str, str | None]] = {}
    for case in ElementTree.parse(report).getroot().iter("testcase"):
        name = f"{case.get('classname', '').rsplit('.', 1)[-1]}.{case.get('name')}"
        outcome = next((child for child in case if child.tag in ("failure", "error", "skipped")), None)
        status = "passed" if outcome is None else {"failure": "failed"}.get(outcome.tag, outcome.tag)
        cause = None if outcome is None or outcome.tag == "skipped" else first_line(outcome)
        if name not in outcomes or outcomes[name][0] in ("passed", "skipped"):
            outcomes[name] = (status, cause)
    for name, (status, cause) in outcomes.items():
        result.counts[status] += 1
        if cause is not None:
            result.causes[cause].append(name)


def report(results: list[EraResult]) -> None:
    for era in results:
        ran = sum(era.counts.values()) - era.counts["skipped"]
        summary = ", ".join(f"{era.counts[s]} {s}" for s in ("passed", "failed", "error", "skipped"))
        print(f"== {era.name}: {era.counts['passed']} of {ran} pass ({summary}; skipped ones are not counted)")
        for cause, tests in sorted(era.causes.items(), key=lambda item: -len(item[1])):
            print(f"  [{len(tests)}] {cause}")
            for test in tests:
                print(f"        {test}")
    passed = sum(era.counts["passed"] for era in results)
    ran = sum(sum(era.counts.values()) - era.counts["skipped"] for era in results)
    print(f"== all eras: {passed} of {ran} pass")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("eras", nargs="*", type=Path, help="folders holding an era's test file and fake_engine.py")
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds allowed per era (default 3600)")
    parser.add_argument("-k", dest="keyword", help="pytest -k expression, to rerun a subset")
    parser.add_argument("--per-test-timeout", type=float, help="fail a test that runs longer (needs pytest-timeout)")
    parser.add_argument("--keep-reports", type=Path, help="copy each era's JUnit report into this folder")
    parser.add_argument("--reports", type=Path, nargs="+", help="summarise kept JUnit reports instead of running")
    parser.add_argument("--compiled", action="store_true",
                        help="import the mypyc build in build/compiled (production mode) instead of the sources")
    parser.add_argument("--log", type=Path, help="append pytest's verbose output to this file (progress, tracebacks)")
    args = parser.parse_args()
    if args.reports:
        results = []
        for kept in args.reports:
            results.append(EraResult(kept.stem))
            read_report(kept, results[-1])
        report(results)
        return
    report([
        run_era(folder, args.timeout, args.keyword, args.log, args.per_test_timeout, args.keep_reports, args.compiled)
        for folder in args.eras
    ])


if __name__ == "__main__":
    main()
