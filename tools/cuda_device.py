"""The GPU tools' common start: CuPy with a device to run on, or one line saying why there is nothing to do."""

from __future__ import annotations

from types import ModuleType


def cupy_with_device(tool: str) -> ModuleType | None:
    """CuPy when it sees a CUDA device; otherwise None, after printing why ``tool`` has nothing to do."""
    try:
        import cupy
    except ImportError:
        print(f"{tool}: CuPy is not installed; nothing to do (needs a CUDA GPU).")
        return None
    if not cupy.is_available():
        print(f"{tool}: CuPy sees no CUDA device; nothing to do (run this on a GPU machine).")
        return None
    module: ModuleType = cupy
    return module


def device_name(cupy: ModuleType) -> str:
    """The current device's name, as the driver reports it."""
    runtime = cupy.cuda.runtime
    return str(runtime.getDeviceProperties(runtime.getDevice())["name"].decode())
