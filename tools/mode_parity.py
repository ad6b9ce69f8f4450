"""Differential check of the two modes: the same seeded workloads in interpreted and compiled mode, everything a
user can observe compared, types included.

    python tools/mode_parity.py                      # every scenario, a few seconds each
    python tools/mode_parity.py --scenario workload --operations 2000 --seed 3

Each scenario runs in one child process per mode (``--child-mode``: the sources, or ``build/compiled`` /
``KV_CACHE_MANAGER_V2_BUILD_DIR``; ``PYTHONHASHSEED=0``) and prints a transcript: one record per public call with
its return value described with its exact type at every level (``bool`` vs ``numpy.bool_``, ``int`` vs
``numpy.int64``, ``tuple`` vs ``list``, a value object's public fields and repr) or the exception's type and
message, then the warnings and the package's log records it issued. The parent compares the two transcripts record
by record and prints where the first few differ. Scenarios (``tools/parity/``): ``workload`` (random public calls
on the fuzzer's manager setups: lifecycle, batches, quotas, probes, refusals, statistics, usage, both kinds of
events, NumPy and bad arguments), ``sweep`` (every bad value of ``tests/test_edge_sweep.py``'s parameters, and
their valid calls with NumPy integers), ``arguments`` (every integer parameter of the public surface given
``True``, ``numpy.True_`` and a ``numpy.int64``, every bool one ``1`` and ``numpy.True_``: ``tests/test_bool_args.py``'s
calls), ``inputs`` (subclasses of int/str/bytes/list, arrays and ranges as
tokens, IntEnum members as ints), ``subclasses`` (a user subclass of every exported class: defined, then made
without arguments), ``fuzz`` (the stateful fuzzer under ``tools/soak.py``'s seeded driver, every check after every
operation, its statistics; not ``drop_in_cycle``, whose collector runs at an allocation count), ``pickles`` (value objects: pickled in one mode and loaded in the other, copied,
compared, hashed, printed) and ``simulate`` (the simulator's ``--json`` report and printed tables, timings left
out). Memory addresses and temporary paths compare as placeholders. Two documented differences are accepted:
mypyc's own ``TypeError`` for a wrong concrete type or a missing argument where the interpreted mode raises
``TypeError`` too (``tests/test_bad_inputs.py``), and a ``ReuseScope`` subclass (not tried). Exits 1 on any other
difference, 2 without a compiled build. ``tests/test_mode_parity.py`` runs a short version of each scenario.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SCENARIOS = ("workload", "sweep", "arguments", "inputs", "subclasses", "fuzz", "pickles", "simulate")
# mypyc's own argument checks: "str object expected; got int", "__init__() missing required argument 'x' (pos 1)"
MYPYC_TYPE_ERRORS = (" expected; got ", "missing required argument")


def compiled_dir() -> Path:
    return Path(os.environ.get("KV_CACHE_MANAGER_V2_BUILD_DIR", str(REPO / "build" / "compiled")))


def compiled_build_present() -> bool:
    return any((compiled_dir() / "kv_cache_manager_v2" / "_manager").glob("manager.*.so"))


def select_mode(mode: str) -> None:
    """In a child: import the package of ``mode`` (the tests and tools always from the sources)."""
    sys.path.insert(0, str(REPO))
    if mode == "compiled":
        sys.path.insert(0, str(compiled_dir()))
    import kv_cache_manager_v2
    from kv_cache_manager_v2._manager import manager

    if kv_cache_manager_v2.COMPILED != (mode == "compiled") or str(manager.__file__).endswith(".so") != (mode == "compiled"):
        raise RuntimeError(f"asked for {mode} mode, imported {manager.__file__}")


def run_child(mode: str, scenario: str, args: list[str], stdin: str = "") -> list[object]:
    """One scenario in a fresh process of ``mode``; its transcript (the child's last stdout line, JSON)."""
    env = dict(os.environ, PYTHONHASHSEED="0", KV_CACHE_MANAGER_V2_MODE=mode)
    result = subprocess.run(
        [sys.executable, __file__, "--child-mode", mode, "--scenario", scenario, *args],
        input=stdin, capture_output=True, text=True, env=env, cwd=REPO,
    )
    if result.returncode != 0:
        raise RuntimeError(f"{scenario} in {mode} mode exited {result.returncode}:\n{result.stdout}\n{result.stderr}")
    transcript = json.loads(result.stdout.strip().splitlines()[-1])
    assert isinstance(transcript, list)
    return transcript


def accepted_difference(fast: object, compiled: object) -> bool:
    """mypyc's TypeError for a wrong concrete type or a missing argument, where the interpreted mode raised a
    TypeError too (with the same warnings and log records)."""
    return (
        isinstance(fast, list) and isinstance(compiled, list) and len(fast) == len(compiled) >= 3
        and fast[3:] == compiled[3:]
        and fast[0] == compiled[0] == "raised" and fast[1] == compiled[1] == "builtins.TypeError"
        and any(wording in str(compiled[2]) for wording in MYPYC_TYPE_ERRORS)
    )


def first_difference(one: object, other: object, path: str) -> tuple[str, object, object]:
    """Where two described values first differ (a path of list indices) and the two parts there."""
    if isinstance(one, list) and isinstance(other, list) and len(one) == len(other):
        for index, (left, right) in enumerate(zip(one, other)):
            if left != right:
                return first_difference(left, right, f"{path}[{index}]")
    return path or "[]", one, other


def compare(fast: list[object], compiled: list[object], limit: int = 10) -> list[str]:
    """The differing records of two transcripts (``[label, outcome]`` each), at most ``limit`` of them."""
    differences: list[str] = []
    if len(fast) != len(compiled):
        differences.append(f"transcript lengths differ: fast {len(fast)}, compiled {len(compiled)}")
    for index, (one, other) in enumerate(zip(fast, compiled)):
        if one != other and not (
            isinstance(one, list) and isinstance(other, list) and one[0] == other[0]
            and accepted_difference(one[1], other[1])
        ):
            path, fast_part, compiled_part = first_difference(one, other, "")
            differences.append(
                f"record {index} ({json.dumps(one)[:80]}...) at {path}:\n  fast:     {json.dumps(fast_part)[:400]}"
                f"\n  compiled: {json.dumps(compiled_part)[:400]}"
            )
            if len(differences) >= limit:
                break
    return differences


def check_scenario(scenario: str, args: list[str]) -> list[str]:
    """Run ``scenario`` in both modes; the differences (the pickles scenario crosses: each mode loads the other's)."""
    if scenario != "pickles":
        return compare(run_child("fast", scenario, args), run_child("compiled", scenario, args))
    written = {mode: run_child(mode, "pickles", args) for mode in ("fast", "compiled")}
    originals = {mode: [row[:2] for row in rows] for mode, rows in written.items()}  # type: ignore[index]
    differences = compare(originals["fast"], originals["compiled"])
    for writer, reader in (("fast", "compiled"), ("compiled", "fast")):
        read = run_child(reader, "unpickles", args, stdin=json.dumps(written[writer]))
        differences += [f"pickled {writer}, loaded {reader}: {d}" for d in compare(originals[writer], read)]
    return differences


def child_main(mode: str, scenario: str, options: argparse.Namespace) -> None:
    select_mode(mode)
    from tools.parity import inputs, runs, scenarios

    if scenario == "unpickles":
        transcript = runs.unpickle_all(json.loads(sys.stdin.read()))
    elif scenario == "pickles":
        transcript = runs.pickle_all(options.seed)
    elif scenario == "workload":
        transcript = scenarios.workload(options.seed, options.operations)
    elif scenario == "sweep":
        transcript = runs.sweep()
    elif scenario == "arguments":
        transcript = runs.arguments()
    elif scenario == "inputs":
        transcript = inputs.inputs()
    elif scenario == "subclasses":
        transcript = inputs.subclasses()
    elif scenario == "fuzz":
        transcript = runs.fuzz(options.seed, options.operations)
    else:
        with tempfile.TemporaryDirectory() as directory:
            transcript = runs.simulate(options.seed, directory)
    print(json.dumps(transcript))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--scenario", action="append", choices=(*SCENARIOS, "unpickles"), help="default: all")
    parser.add_argument("--seed", type=int, default=0, help="seed of the workloads (default 0)")
    parser.add_argument("--operations", type=int, default=600, help="operations of workload/fuzz (default 600)")
    parser.add_argument("--child-mode", choices=("fast", "compiled"), help=argparse.SUPPRESS)
    options = parser.parse_args(argv)
    if options.child_mode:
        child_main(options.child_mode, options.scenario[0], options)
        return 0
    if not compiled_build_present():
        print(f"no compiled build under {compiled_dir()}: python setup_mypyc.py build --build-lib build/compiled "
              "--build-temp build/temp", file=sys.stderr)
        return 2
    failed = False
    for scenario in options.scenario or SCENARIOS:
        differences = check_scenario(scenario, ["--seed", str(options.seed), "--operations", str(options.operations)])
        print(f"{scenario}: {'same in both modes' if not differences else f'{len(differences)} difference(s)'}")
        for difference in differences:
            print(difference)
        failed = failed or bool(differences)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
