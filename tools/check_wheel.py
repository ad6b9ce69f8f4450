"""Check that a compiled wheel holds an extension module for every compiled source and ships the CUDA sources
and the hybrid model's data files."""

from __future__ import annotations

import glob
import os
import sys
import zipfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from setup_mypyc import compiled_sources  # noqa: E402


def main(wheel: str) -> int:
    names = zipfile.ZipFile(wheel).namelist()
    missing = []
    for source in compiled_sources():
        stem = source[: -len(".py")]
        if not any(name.startswith(stem + ".") and name.endswith(".so") for name in names):
            missing.append(source)
    kernels = [os.path.basename(path) for path in glob.glob("kernels/*.cu*")]
    shipped = {os.path.basename(name) for name in names if "/kernels/cuda/" in name}
    missing += [f"kernels/{name}" for name in kernels if name not in shipped]
    if "kv_cache_manager_v2/py.typed" not in names:
        missing.append("py.typed")
    for data in ("bamba_tiny.npz", "bamba_tiny_golden.npz"):  # the hybrid model's weights and golden logits
        if f"kv_cache_manager_v2/models/data/{data}" not in names:
            missing.append(f"models/data/{data}")
    if missing:
        print(f"{wheel} lacks: {missing}")
        return 1
    print(f"{wheel}: {len(compiled_sources())} compiled modules, {len(kernels)} CUDA sources, py.typed")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
