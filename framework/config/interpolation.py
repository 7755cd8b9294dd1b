"""Bounding OmegaConf interpolation before anything resolves it.

Why: OmegaConf resolves ``${a}${a}`` by building the string, and it does not cache node
interpolations, so a chain of 40 doubling keys costs 2^40 characters and time: every launch hangs
with no output. ``check_expansion`` estimates each value's expanded length from the references in
its interpolations (OmegaConf's own grammar parser, memoised per key, so the estimate is linear in
the config) and refuses, naming the key, a value that would exceed ``MAX_CHARS``, a reference
chain deeper than ``MAX_DEPTH``, a cycle, or a computed key (``${${name}}``), whose target cannot be
known without resolving. ``resolver_calls`` lists the resolvers a value calls (recipes may call
none, see framework.launch.recipe_check).
"""

from __future__ import annotations

import re
from typing import Any

from omegaconf import grammar_parser
from omegaconf.errors import GrammarParseError
from omegaconf.grammar.gen.OmegaConfGrammarParser import OmegaConfGrammarParser as Grammar

MAX_CHARS = 1 << 20  # 1 Mi characters for one value: a config's longest real value is a path
MAX_DEPTH = 32  # references followed from one value
RESOLVER_SIZE = 4096  # assumed output of one resolver call beyond its arguments (a path, a stamp)

Path = tuple[Any, ...]


class _ValueProblem(ValueError):
    """A problem of one value's text (grammar, computed key); the caller adds the key's name."""


def _parse(value: str) -> Any:
    try:
        return grammar_parser.parse(value)
    except GrammarParseError as e:
        raise _ValueProblem(f"invalid interpolation ({' '.join(str(e).split())[:200]})") from None


def _children(ctx: Any) -> list[Any]:
    return list(ctx.getChildren()) if hasattr(ctx, "getChildren") else []


def resolver_calls(value: str) -> list[str]:
    """The resolver names ``value`` calls (nested calls included), in order; [] without ``${``.

    Raises ValueError for a grammar error or a computed resolver name (``${${x}:y}``).
    """
    if "${" not in value:
        return []
    names: list[str] = []

    def walk(ctx: Any) -> None:
        if isinstance(ctx, Grammar.InterpolationResolverContext):
            name = ctx.resolverName()
            if any(isinstance(c, Grammar.InterpolationContext) for c in _children(name)):
                raise _ValueProblem(f"a computed resolver name {name.getText()!r}")
            names.append(name.getText())
        for c in _children(ctx):
            walk(c)

    walk(_parse(value))
    return names


_SPLIT = re.compile(r"[.\[\]]")


def _target(text: str, here: Path) -> Path:
    """The absolute key path of ``${text}`` written in the value at ``here``."""
    body = text[2:-1].strip()
    if "${" in body:
        raise _ValueProblem(f"a computed key {text!r} (its target is only known by resolving it)")
    dots = len(body) - len(body.lstrip("."))
    parts = tuple(p for p in _SPLIT.split(body[dots:]) if p)
    if dots == 0:
        return parts
    base = here[:-1]  # the container holding this value
    up = dots - 1
    if up > len(base):
        raise _ValueProblem(f"{text!r} climbs above the config's root")
    return base[: len(base) - up] + parts


def _lookup(tree: Any, path: Path) -> tuple[bool, Any]:
    node = tree
    for part in path:
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif (
            isinstance(node, list) and str(part).lstrip("-").isdigit() and -len(node) <= int(part) < len(node)
        ):
            node = node[int(part)]
        else:
            return False, None
    return True, node


def _dotted(path: Path) -> str:
    return ".".join(str(p) for p in path) or "<root>"


def check_expansion(
    tree: dict[str, Any], max_chars: int = MAX_CHARS, max_depth: int = MAX_DEPTH, missing_size: int = 0
) -> None:
    """Raise ValueError naming the key when a value of the unresolved ``tree`` would expand too far.

    ``tree`` is a plain container (``OmegaConf.to_container(cfg, resolve=False)``). A reference to a
    key that is not in ``tree`` counts ``missing_size`` characters (a recipe checked on its own
    refers to conf/'s keys). See the module docstring for what is refused.
    """
    memo: dict[Path, int] = {}
    stack: list[Path] = []

    def size_of(path: Path) -> int:
        if path in memo:
            return memo[path]
        if path in stack:
            cycle = " -> ".join(_dotted(p) for p in [*stack[stack.index(path) :], path])
            raise ValueError(f"{_dotted(path)}: recursive interpolation (a cycle: {cycle})")
        if len(stack) >= max_depth:
            raise ValueError(
                f"{_dotted(stack[0])}: interpolation references nest deeper than {max_depth} keys"
            )
        found, node = _lookup(tree, path)
        if not found:
            return missing_size
        stack.append(path)
        try:
            size = node_size(node, path)
        finally:
            stack.pop()
        if size > max_chars:
            raise ValueError(
                f"{_dotted(path)} would expand to more than {max_chars} characters through its "
                "interpolations (e.g. a string-doubling chain); valid: values up to that size"
            )
        memo[path] = size
        return size

    def node_size(node: Any, path: Path) -> int:
        if isinstance(node, dict):
            return 2 + sum(size_of((*path, k)) + len(str(k)) + 2 for k in node)
        if isinstance(node, list):
            return 2 + sum(size_of((*path, i)) + 2 for i in range(len(node)))
        if isinstance(node, str) and "${" in node:
            try:
                return string_size(_parse(node), path)
            except _ValueProblem as e:
                raise ValueError(f"{_dotted(path)}={node[:80]!r}: {e}") from None
        return len(str(node))

    def string_size(ctx: Any, path: Path) -> int:
        if isinstance(ctx, Grammar.InterpolationNodeContext):
            return size_of(_target(ctx.getText(), path))
        kids = _children(ctx)
        if not kids:
            text = ctx.getText()
            return 0 if text == "<EOF>" else len(text)
        extra = RESOLVER_SIZE if isinstance(ctx, Grammar.InterpolationResolverContext) else 0
        total = extra
        for c in kids:
            total += string_size(c, path)
            if total > max_chars:
                break
        return total

    for key in tree:
        size_of((key,))
