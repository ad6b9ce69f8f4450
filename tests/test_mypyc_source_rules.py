"""Source shapes that mypyc's build rejects, found here in seconds instead of in the compiled run's five minutes.

Each rule is one the build once failed on:
- a required keyword-only parameter after a positional one with a default (``def f(a=1, *, b)``): valid Python,
  but mypyc's text signature for the method table raises "non-default argument follows default argument", so
  ``KVSender(manager, connection, timeout_s=60.0, *, kv_format)`` broke the whole build;
- a native attribute named ``_x`` becomes the C field ``__x``, so ``self._thread`` is the C keyword ``__thread``.
"""

from __future__ import annotations

import ast
import keyword
from pathlib import Path

import pytest

from setup_mypyc import compiled_sources

pytestmark = pytest.mark.mode_independent  # reads the sources

ROOT = Path(__file__).resolve().parent.parent

C_KEYWORDS = frozenset(
    "auto break case char const continue default do double else enum extern float for goto if inline int long "
    "register restrict return short signed sizeof static struct switch typedef union unsigned void volatile while "
    "thread".split()
)


def compiled_trees() -> list[tuple[str, ast.Module]]:
    return [(path, ast.parse((ROOT / path).read_text(), path)) for path in compiled_sources()]


def required_keyword_only_after_default(function: ast.FunctionDef | ast.AsyncFunctionDef) -> str | None:
    positional = function.args.posonlyargs + function.args.args
    if not function.args.defaults or function.args.vararg is not None:
        return None
    for argument, default in zip(function.args.kwonlyargs, function.args.kw_defaults):
        if default is None:
            first_default = positional[len(positional) - len(function.args.defaults)].arg
            return f"{function.name}: keyword-only {argument.arg!r} has no default after {first_default!r} has one"
    return None


def test_no_required_keyword_only_parameter_follows_a_default() -> None:
    found = [
        f"{path}:{node.lineno} {problem}"
        for path, tree in compiled_trees()
        for node in ast.walk(tree)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        and (problem := required_keyword_only_after_default(node)) is not None
    ]
    assert not found, "mypyc cannot build these (put the keyword-only one first or give it a default):\n" + "\n".join(found)


def test_no_self_attribute_becomes_a_c_keyword() -> None:
    found = [
        f"{path}:{node.lineno} self.{node.attr}"
        for path, tree in compiled_trees()
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute)
        and isinstance(node.value, ast.Name)
        and node.value.id == "self"
        and node.attr.startswith("_")
        and not node.attr.startswith("__")
        and node.attr[1:] in C_KEYWORDS
    ]
    assert not found, "mypyc names self._x as the C field __x; these are C keywords:\n" + "\n".join(found)


@pytest.mark.parametrize(
    ("source", "flagged"),
    [
        ("def f(a, b=1, *, c): pass", True),
        ("def f(a, *, c, b=1): pass", False),
        ("def f(a, b=1, *, c=2): pass", False),
        ("def f(a, b=1, *args, c): pass", False),
    ],
)
def test_the_rule_flags_exactly_the_shape_mypyc_rejects(source: str, flagged: bool) -> None:
    function = ast.parse(source).body[0]
    assert isinstance(function, ast.FunctionDef)
    assert (required_keyword_only_after_default(function) is not None) is flagged
    assert not keyword.iskeyword("thread")  # a C keyword only: Python would catch a Python one itself
