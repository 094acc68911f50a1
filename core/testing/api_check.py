"""Bind a plugin's calls against a library's real signatures, read from its source (no import).

`signature_in(source, "Class.method")` parses a module's source with `ast` and returns the
`inspect.Signature` of the function or method defined last under that name (an `@overload`d
method's implementation comes last); `Recorder` wraps callables so a test can run a backend
and then bind every call it made (`inspect.Signature.bind` raises TypeError on a missing,
unknown or duplicated argument).
"""

from __future__ import annotations

import ast
import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


def _parameters(args: ast.arguments) -> list[inspect.Parameter]:
    P = inspect.Parameter
    params: list[inspect.Parameter] = []
    positional = [*args.posonlyargs, *args.args]
    defaults = [P.empty] * (len(positional) - len(args.defaults)) + list(args.defaults)
    for i, (arg, default) in enumerate(zip(positional, defaults, strict=True)):
        kind = P.POSITIONAL_ONLY if i < len(args.posonlyargs) else P.POSITIONAL_OR_KEYWORD
        params.append(P(arg.arg, kind, default=default))
    if args.vararg:
        params.append(P(args.vararg.arg, P.VAR_POSITIONAL))
    for arg, kw_default in zip(args.kwonlyargs, args.kw_defaults, strict=True):
        params.append(P(arg.arg, P.KEYWORD_ONLY,
                        default=P.empty if kw_default is None else kw_default))
    if args.kwarg:
        params.append(P(args.kwarg.arg, P.VAR_KEYWORD))
    return params


def signature_in(source: str, qualname: str) -> inspect.Signature:
    """The signature of `qualname` ("func" or "Class.method") as `source` defines it last."""
    tree = ast.parse(source)
    owner_name, _, name = qualname.rpartition(".")
    scope: list[ast.stmt] = tree.body
    if owner_name:
        owner = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == owner_name]
        if not owner:
            raise LookupError(f"class {owner_name} is not defined in the source")
        scope = owner[-1].body
    defs = [n for n in scope if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)
            and n.name == name]
    if not defs:
        raise LookupError(f"{qualname} is not defined in the source")
    return inspect.Signature(_parameters(defs[-1].args))


@dataclass
class Call:
    name: str
    args: tuple[Any, ...]
    kwargs: dict[str, Any]


@dataclass
class Recorder:
    """Wraps callables so the calls made through them are kept, in order."""

    calls: list[Call] = field(default_factory=list)

    def wrap(self, name: str, func: Callable[..., Any]) -> Callable[..., Any]:
        def recorded(*args: Any, **kwargs: Any) -> Any:
            self.calls.append(Call(name, args, dict(kwargs)))
            return func(*args, **kwargs)
        return recorded

    def named(self, name: str) -> list[Call]:
        return [c for c in self.calls if c.name == name]
