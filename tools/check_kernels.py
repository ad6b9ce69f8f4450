"""Compile every kernels/*.cu to an sm_90 CUBIN with NVRTC, without a GPU (CI has none).

Uses the low-level ``cupy.cuda.nvrtc`` API and the NVRTC of the ``nvidia-cuda-nvrtc-cu12`` wheel; headers come from
``nvidia-cuda-runtime-cu12`` (cuda_fp16.h, ...), CuPy's include directory and kernels/ itself. Compiling to a CUBIN
(not PTX) runs ptxas too, which catches resource errors such as too much shared memory. Prints one line per file
with compile time and CUBIN size; exits 1 on any failure, after printing NVRTC's log. Files compile in parallel, one
process per core: the tensor-core attention kernel alone takes over a minute.

    python tools/check_kernels.py [kernels/page_copy.cu ...]

Needs the ``test-cuda`` extra (``pip install -e ".[test,test-cuda]"``); without it, says so and exits 2.
"""

from __future__ import annotations

import glob
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor

try:
    import cupy
    import nvidia.cuda_runtime
    from cupy.cuda import nvrtc
except ImportError as missing:
    print(f"check_kernels.py needs CuPy and the NVRTC wheels: pip install -e \".[test,test-cuda]\" ({missing})",
          file=sys.stderr)
    sys.exit(2)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KERNELS = os.path.join(REPO, "kernels")
ARCH = "sm_90"


def include_dirs() -> list[str]:
    runtime = [os.path.join(path, "include") for path in nvidia.cuda_runtime.__path__]
    return [*runtime, os.path.join(os.path.dirname(cupy.__file__), "_core", "include"), KERNELS]


def compile_cubin(path: str, options: list[str]) -> tuple[bytes | None, str]:
    """The CUBIN (None on failure) and NVRTC's log."""
    with open(path, encoding="utf-8") as handle:
        source = handle.read()
    program = nvrtc.createProgram(source, os.path.basename(path), [], [])
    try:
        try:
            nvrtc.compileProgram(program, options)
        except nvrtc.NVRTCError:
            return None, nvrtc.getProgramLog(program)
        return nvrtc.getCUBIN(program), nvrtc.getProgramLog(program)
    finally:
        nvrtc.destroyProgram(program)


def compile_timed(path: str, options: list[str]) -> tuple[bytes | None, str, float]:
    start = time.perf_counter()
    cubin, log = compile_cubin(path, options)
    return cubin, log, time.perf_counter() - start


def main(argv: list[str]) -> int:
    paths = argv or sorted(glob.glob(os.path.join(KERNELS, "*.cu")))
    if not paths:
        print(f"no .cu files in {KERNELS}", file=sys.stderr)
        return 1
    options = [f"-arch={ARCH}", "--std=c++17", *(f"-I{path}" for path in include_dirs())]
    major, minor = nvrtc.getVersion()
    print(f"NVRTC {major}.{minor}, -arch={ARCH}")
    failures = 0
    with ProcessPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        results = list(pool.map(compile_timed, paths, [options] * len(paths)))
    for path, (cubin, log, seconds) in zip(paths, results):
        name = os.path.relpath(path, REPO)
        if cubin is None:
            failures += 1
            print(f"FAIL {name} ({seconds:.2f} s)\n{log}")
        else:
            print(f"ok   {name}: {seconds:.2f} s, cubin {len(cubin):,} bytes")
            if log.strip():
                print(log)
    if failures:
        print(f"{failures} of {len(paths)} kernel file(s) failed to compile", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
