"""Type completeness of the installed package as a downstream checker sees it (issue #39): ``pyright
--verifytypes kv_cache_manager_v2 --ignoreexternal`` must score at least the threshold with no symbol of unknown
type, so an unannotated public attribute cannot slip back in. Run by ``.ci/run`` after the editable install.

pyright resolves the package through the ``python`` first on ``PATH`` (not ``--pythonpath``), so this puts the
running interpreter's directory first; it refuses to score an install of another checkout.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def verify_types() -> dict[str, object]:
    """pyright's ``typeCompleteness`` object for the package installed in this interpreter's environment."""
    env = dict(os.environ, PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
    command = [sys.executable, "-m", "pyright", "--verifytypes", "kv_cache_manager_v2", "--ignoreexternal",
               "--outputjson"]
    result = subprocess.run(command, capture_output=True, text=True, env=env, cwd=REPO.parent)
    try:
        report = json.loads(result.stdout)
    except json.JSONDecodeError:
        raise SystemExit(f"pyright gave no JSON report (exit {result.returncode}): {result.stderr[-2000:]}") from None
    completeness: dict[str, object] = report["typeCompleteness"]
    return completeness


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threshold", type=float, default=0.99, help="lowest accepted score (0..1)")
    args = parser.parse_args()
    completeness = verify_types()
    root = Path(str(completeness.get("packageRootDirectory", "")))
    if (root / "__init__.py").resolve() != REPO / "kv_cache_manager_v2" / "__init__.py":
        print(f"pyright found kv_cache_manager_v2 at {root}, not this checkout: install it first", file=sys.stderr)
        return 1
    counts = completeness["exportedSymbolCounts"]
    assert isinstance(counts, dict)
    score = float(str(completeness["completenessScore"]))
    print(f"type completeness {score:.1%}: {counts}")
    if score < args.threshold or counts["withUnknownType"] != 0:
        print(f"below {args.threshold:.1%} or unknown types: run pyright --verifytypes kv_cache_manager_v2 "
              "--ignoreexternal for the symbols", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
