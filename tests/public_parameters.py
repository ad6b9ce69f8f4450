"""The public surface's integer, float and bool parameters, as the sources annotate them.

The surface is what an engine imports: the package's exported names, ``disagg``'s and those of the subpackages in
``ENGINE_FACING_PACKAGES`` (``tests/test_docstrings.py`` checks their docstrings, and ``disagg``'s), and the functions in
``DOCUMENTED_ELSEWHERE``. Each exported function, each
exported class's constructor (a dataclass's or NamedTuple's fields), its public methods and property setters, the
package's base classes included (``KVCacheManager`` is written in layers). Compiled functions carry no annotations,
so the walk reads them from the sources; it runs the same in both modes.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import os
import sys
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Iterator

import kv_cache_manager_v2

REPO = Path(__file__).resolve().parent.parent
ENGINE_FACING_PACKAGES = ("kv_cache_manager_v2.kv_events", "kv_cache_manager_v2.batching", "kv_cache_manager_v2.testing")
# Public functions README documents outside an ``__all__`` (``listen(count=0)`` is refused like ``--count 0``).
DOCUMENTED_ELSEWHERE = (("kv_cache_manager_v2.kv_events.listen", "listen"),)
# Annotations (a union's members, None left out) of the parameters walked.
INTEGER = frozenset({"int", "SupportsIndex"})
NUMBER = frozenset({"float", "SupportsFloat"})
WALKED = INTEGER | NUMBER | {"bool"}


@dataclass(frozen=True)
class Parameter:
    """One parameter: ``owner`` is a function's or class's exported name (a constructor), or ``Class.method``."""

    owner: str
    name: str
    kinds: frozenset[str]  # the annotation's union members but None: {"int"}, {"SupportsIndex"}, {"bool"}, ...
    module: str  # where the sources define it
    # Checked by mypyc at the call when compiled: not in a module mypyc leaves interpreted, nor a field of a
    # non-native class (``mypyc_attr(native_class=False)``) or NamedTuple, whose ``__init__`` is generated at run time.
    compiled_boundary: bool

    @property
    def label(self) -> str:
        return f"{self.owner}({self.name}: {' | '.join(sorted(self.kinds))})"


def disagg_public_names() -> set[str]:
    """What ``disagg`` defines or re-exports explicitly (``import X as X``), not what it merely uses."""
    tree = ast.parse((REPO / "kv_cache_manager_v2" / "disagg.py").read_text())
    names = {node.name for node in tree.body if isinstance(node, (ast.FunctionDef, ast.ClassDef))}
    for node in tree.body:
        if isinstance(node, ast.ImportFrom):
            names.update(alias.name for alias in node.names if alias.asname == alias.name)
    return {name for name in names if not name.startswith("_")}


def exported() -> dict[str, object]:
    """Public name -> the package's own class or function, over the whole surface."""
    found = {name: getattr(kv_cache_manager_v2, name) for name in dir(kv_cache_manager_v2) if not name.startswith("_")}
    disagg = importlib.import_module("kv_cache_manager_v2.disagg")
    found.update({name: getattr(disagg, name) for name in disagg_public_names()})
    for package in ENGINE_FACING_PACKAGES:
        module = importlib.import_module(package)
        found.update({name: getattr(module, name) for name in getattr(module, "__all__")})
    for module_name, name in DOCUMENTED_ELSEWHERE:
        found[name] = getattr(importlib.import_module(module_name), name)
    return {
        name: value for name, value in found.items()
        if (inspect.isclass(value) or inspect.isroutine(value))
        and str(getattr(value, "__module__", "")).startswith("kv_cache_manager_v2")
    }


@lru_cache(maxsize=None)
def compiled_modules() -> frozenset[str]:
    sys.path.insert(0, str(REPO))
    previous = os.getcwd()
    os.chdir(REPO)  # compiled_sources globs from the repository root
    try:
        from setup_mypyc import compiled_sources

        return frozenset(path[: -len(".py")].replace(os.sep, ".") for path in compiled_sources())
    finally:
        os.chdir(previous)
        sys.path.remove(str(REPO))


@lru_cache(maxsize=None)
def module_tree(module: str) -> ast.Module:
    return ast.parse((REPO / (module.replace(".", "/") + ".py")).read_text())


def definition(value: object) -> ast.stmt:
    module = str(getattr(value, "__module__"))
    return next(node for node in module_tree(module).body if getattr(node, "name", None) == getattr(value, "__name__"))


def kinds_of(annotation: ast.expr) -> frozenset[str]:
    """The members of an annotation's union, ``None`` left out: ``int | None``, ``Optional[int]``, ``"int"``."""
    found: set[str] = set()
    pending = [annotation]
    while pending:
        node = pending.pop()
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            pending.append(ast.parse(node.value, mode="eval").body)
        elif isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitOr):
            pending += [node.left, node.right]
        elif isinstance(node, ast.Subscript) and ast.unparse(node.value).split(".")[-1] in ("Optional", "Union"):
            pending += list(node.slice.elts) if isinstance(node.slice, ast.Tuple) else [node.slice]
        else:
            found.add(ast.unparse(node))
    return frozenset(found - {"None"})


def walked_kinds(annotation: ast.expr | None) -> frozenset[str] | None:
    """The annotation's kinds when they are all integer, float or bool ones (``int | str`` is another kind)."""
    if annotation is None:
        return None
    kinds = kinds_of(annotation)
    return kinds if kinds and kinds <= WALKED else None


def function_parameters(owner: str, function: ast.FunctionDef, module: str) -> Iterator[Parameter]:
    arguments = function.args.posonlyargs + function.args.args + function.args.kwonlyargs
    for argument in arguments:
        kinds = walked_kinds(argument.annotation)
        if kinds is not None:
            yield Parameter(owner, argument.arg, kinds, module, module in compiled_modules())


def class_parameters(name: str, owner: type) -> Iterator[tuple[str, Parameter]]:
    """``(member, parameter)`` of one class of the MRO: its fields (a dataclass's or NamedTuple's), constructor,
    public methods and setters."""
    node = definition(owner)
    assert isinstance(node, ast.ClassDef)
    module = owner.__module__
    decorators = [ast.unparse(decorator) for decorator in node.decorator_list]
    named_tuple = "NamedTuple" in map(ast.unparse, node.bases)
    record = named_tuple or any(decorator.startswith(("dataclass", "dataclasses.dataclass")) for decorator in decorators)
    generated_init = named_tuple or any("native_class=False" in decorator for decorator in decorators)
    for item in node.body:
        if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name) and record:
            kinds = walked_kinds(item.annotation)
            if kinds is not None:
                boundary = module in compiled_modules() and not generated_init
                yield item.target.id, Parameter(name, item.target.id, kinds, module, boundary)
        elif isinstance(item, ast.FunctionDef) and (item.name == "__init__" or not item.name.startswith("_")):
            item_decorators = [ast.unparse(decorator) for decorator in item.decorator_list]
            if "property" in item_decorators:
                continue
            qualified = name if item.name == "__init__" else f"{name}.{item.name}"
            if f"{item.name}.setter" in item_decorators:  # ``cache.capacity = value``: the property names it
                for parameter in function_parameters(qualified, item, module):
                    yield f"{item.name}=", Parameter(qualified, item.name, parameter.kinds, module,
                                                     parameter.compiled_boundary)
                continue
            yield from ((item.name, parameter) for parameter in function_parameters(qualified, item, module))


def defined_members(owner: type) -> set[str]:
    """The names a class's body defines, as ``class_parameters`` names them (a setter as ``name=``)."""
    node = definition(owner)
    assert isinstance(node, ast.ClassDef)
    names: set[str] = set()
    for item in node.body:
        if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
            names.add(item.target.id)
        elif isinstance(item, ast.FunctionDef):
            setter = f"{item.name}.setter" in map(ast.unparse, item.decorator_list)
            names.add(f"{item.name}=" if setter else item.name)
    return names


@lru_cache(maxsize=None)
def public_parameters() -> tuple[Parameter, ...]:
    """Every integer, float or bool parameter of the public surface, once per (owner, name)."""
    found: dict[tuple[str, str], Parameter] = {}
    for name, value in sorted(exported().items()):
        if not inspect.isclass(value):
            node = definition(value)
            assert isinstance(node, ast.FunctionDef), name
            for parameter in function_parameters(name, node, str(getattr(value, "__module__"))):
                found.setdefault((parameter.owner, parameter.name), parameter)
            continue
        members_seen: set[str] = set()  # a method overridden lower in the MRO is the one that runs
        for owner in inspect.getmro(value):
            if not str(getattr(owner, "__module__", "")).startswith("kv_cache_manager_v2"):
                continue
            for member, parameter in class_parameters(name, owner):
                if member not in members_seen:
                    found.setdefault((parameter.owner, parameter.name), parameter)
            members_seen |= defined_members(owner)
    return tuple(found.values())
