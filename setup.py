"""setuptools entry point: interpreted ("fast") by default, mypyc-compiled with KV_CACHE_MANAGER_V2_COMPILE=1."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from setuptools import setup  # noqa: E402

from setup_mypyc import BuildPyWithKernels, compiled_extensions  # noqa: E402

compile_requested = os.environ.get("KV_CACHE_MANAGER_V2_COMPILE", "") not in ("", "0")
setup(
    ext_modules=compiled_extensions() if compile_requested else [],
    cmdclass={"build_py": BuildPyWithKernels},
)
