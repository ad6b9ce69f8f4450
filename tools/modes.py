"""Run a benchmark body in fast (interpreted) and production (compiled) mode, one subprocess each, one core.

A benchmark script calls ``run_in_both_modes(__file__, args)``; each child re-runs the script with
``--child-mode MODE``, imports the package from the sources or from ``build/compiled`` (built first if missing
or older than a source), and prints one JSON object on its last line.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import subprocess
import sys
from typing import Callable

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COMPILED_DIR = os.path.join(REPO, "build", "compiled")


def ensure_compiled() -> None:
    """Build the compiled mode into build/compiled unless it is newer than every source."""
    sources = glob.glob(os.path.join(REPO, "kv_cache_manager_v2", "**", "*.py"), recursive=True)
    built = glob.glob(os.path.join(COMPILED_DIR, "kv_cache_manager_v2", "*.so"))
    if built and min(os.path.getmtime(path) for path in built) > max(os.path.getmtime(path) for path in sources):
        return
    subprocess.run(
        [sys.executable, "setup_mypyc.py", "build", "--build-lib", "build/compiled", "--build-temp", "build/temp", "-j", "2"],
        cwd=REPO, check=True, stdout=subprocess.DEVNULL,
    )


def select_mode(mode: str) -> None:
    """In a child: put the right package first on sys.path and pin to one core."""
    sys.path.insert(0, COMPILED_DIR if mode == "compiled" else REPO)
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})
    import kv_cache_manager_v2

    if kv_cache_manager_v2.COMPILED != (mode == "compiled"):
        raise RuntimeError(f"asked for {mode} mode, imported {kv_cache_manager_v2.__file__}")


def measure_in_both_modes(script: str, doc: str | None, child: Callable[[], dict[str, float]]) -> dict[str, dict[str, float]]:
    """A benchmark's whole dispatch: as a child (``--child-mode``) print ``child()`` as JSON and exit; as the parent
    run one child per mode and return ``{"fast": ..., "compiled": ...}``."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--child-mode", choices=("fast", "compiled"))
    args = parser.parse_args()
    if args.child_mode:
        select_mode(args.child_mode)
        print(json.dumps(child()))
        sys.exit(0)
    results = run_in_both_modes(script, [])
    return {mode: {key: float(value) for key, value in values.items()} for mode, values in results.items()}  # type: ignore[arg-type]


def run_in_both_modes(script: str, args: list[str]) -> dict[str, dict[str, object]]:
    ensure_compiled()
    results: dict[str, dict[str, object]] = {}
    for mode in ("fast", "compiled"):
        output = subprocess.run(
            [sys.executable, script, "--child-mode", mode, *args], check=True, capture_output=True, text=True
        ).stdout
        results[mode] = json.loads(output.strip().splitlines()[-1])
    return results
