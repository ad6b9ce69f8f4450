"""Build the production (mypyc-compiled) mode of kv_cache_manager_v2.

For the test suite, build into a separate directory (never in place: a ``.so`` beside a ``.py`` shadows it):

    python setup_mypyc.py build --build-lib build/compiled --build-temp build/temp -j 2

then run ``KV_CACHE_MANAGER_V2_MODE=compiled pytest``. For users, ``KV_CACHE_MANAGER_V2_COMPILE=1 pip install .``
makes ``setup.py`` call ``compiled_extensions()`` and yields a compiled wheel.
"""

from __future__ import annotations

import glob
import os
import shutil

from setuptools import Extension, setup
from setuptools.command.build_py import build_py

HERE = os.path.dirname(os.path.abspath(__file__))
PACKAGE = "kv_cache_manager_v2"

# Not compiled, on purpose: __init__.py only re-exports (its typed face is __init__.pyi, which mypy reads in
# its place, so mypyc cannot compile it) and __main__.py is the ``python -m`` entry script.
NOT_COMPILED = ("__init__.py", "__main__.py")
# Not compiled either: the real-model reference engine (``kv_cache_manager_v2/models``). Its time goes to NumPy
# matrix products and the kernels' twins, not to Python-level loops, so compiling it gains nothing; and compiled
# code rejects NumPy scalars wherever ``int``/``float`` is declared, which NumPy-heavy code hands around freely.
# It is still ``mypy --strict`` clean, and it drives the compiled manager in production mode.
# The simulator application (``kv_cache_manager_v2/sim``) is an app on top of the library, not a part of it: its
# time goes to the manager calls it drives (compiled) and the FakeEngine's NumPy checks; left interpreted it can
# use dataclasses and import rich and matplotlib with their own types. The continuous batcher both apps run on
# (``batching``) and the command line (``cli``) are the same kind of code: a loop calling the compiled manager a few
# times per request and step, and argparse / table printing.
NOT_COMPILED_PACKAGES = tuple(
    os.path.join(PACKAGE, name) for name in ("models", "sim", "batching", "cli")
)


def compiled_sources() -> list[str]:
    """Every module of the package that mypyc compiles, as paths relative to the repository root."""
    paths = sorted(glob.glob(os.path.join(PACKAGE, "**", "*.py"), recursive=True))
    return [
        path
        for path in paths
        if os.path.basename(path) not in NOT_COMPILED
        and not any(path.startswith(package + os.sep) for package in NOT_COMPILED_PACKAGES)
    ]


def compiled_extensions() -> list[Extension]:
    from mypyc.build import mypycify

    previous = os.getcwd()
    os.chdir(HERE)
    try:
        extensions = mypycify(["--strict", *compiled_sources()], opt_level="3", multi_file=True)
        # Typed as setuptools' or distutils' Extension; with setuptools imported they are setuptools' own.
        assert all(isinstance(extension, Extension) for extension in extensions)
        return [extension for extension in extensions if isinstance(extension, Extension)]
    finally:
        os.chdir(previous)


class BuildPyWithKernels(build_py):
    """Ship the CUDA sources of the top-level ``kernels/`` inside the package (``kv_cache_manager_v2/kernels/cuda``)."""

    def run(self) -> None:
        super().run()
        target = os.path.join(self.build_lib, PACKAGE, "kernels", "cuda")
        os.makedirs(target, exist_ok=True)
        for source in glob.glob(os.path.join(HERE, "kernels", "*.cu*")):
            shutil.copy2(source, target)


def main() -> None:
    setup(ext_modules=compiled_extensions(), cmdclass={"build_py": BuildPyWithKernels})


if __name__ == "__main__":
    main()
