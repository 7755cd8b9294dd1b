"""Chat templates rendered as transformers' ``apply_chat_template`` renders them, within a budget.

A template from a shared tokenizer folder is untrusted code: it runs in jinja2's sandbox, its
arithmetic is bounded before it is computed (``**``, ``*``, ``+``), and each rendering is bounded
in template lines executed, seconds and characters (``render_bounded``); past any bound it raises
``TemplateBudget``, which framework.data.sft reports as one ValueError naming the record.
"""

from __future__ import annotations

import json
from typing import Any

# What rendering one conversation may cost. A template from a shared folder is untrusted: nested
# loops over range(99999) or ``(10 ** 100000) ** 100000`` hung the launcher. Real templates render
# a conversation in a few hundred template lines and a few KB.
RENDER_MAX_LINES = 1_000_000  # template lines executed (each loop iteration is at least one)
RENDER_MAX_SECONDS = 10.0
RENDER_MAX_CHARS = 4 * 2**20  # output of one rendering
MAX_OPERAND_BITS = 4096  # an int operand or result of ** (a 1233-digit number)
MAX_SEQUENCE = 2**20  # a string or list built by * or +


class TemplateBudget(Exception):
    """A chat template went over its rendering budget (RENDER_MAX_*): reported as one ValueError."""


def _bounded_binop(op: str, left: Any, right: Any) -> Any:
    """``**``, ``*`` and ``+`` with operands and results bounded before they are computed."""
    import operator

    if op == "**" and isinstance(left, int) and isinstance(right, int):
        if right > 0 and abs(left) > 1 and right * max(abs(left), 2).bit_length() > MAX_OPERAND_BITS:
            raise TemplateBudget(f"{left!r:.20} ** {right!r:.20} is above {MAX_OPERAND_BITS} bits")
    if op == "*":
        for seq, n in ((left, right), (right, left)):
            if isinstance(seq, (str, list, tuple)) and isinstance(n, int) and len(seq) * n > MAX_SEQUENCE:
                raise TemplateBudget(f"a sequence of {len(seq)} x {n} is above {MAX_SEQUENCE} items")
    if op == "+" and isinstance(left, (str, list, tuple)) and isinstance(right, (str, list, tuple)):
        if len(left) + len(right) > MAX_SEQUENCE:
            raise TemplateBudget(f"a sequence of {len(left) + len(right)} is above {MAX_SEQUENCE} items")
    ops = {"**": operator.pow, "*": operator.mul, "+": operator.add}
    return ops[op](left, right)


def chat_env() -> Any:
    """transformers' chat-template environment (utils/chat_template_utils.py): a sandbox, since a
    template from a shared folder is untrusted, whose arithmetic is bounded (``_bounded_binop``;
    ``render_bounded`` bounds the loops). ``{% generation %}`` blocks render their body (transformers
    tracks their offsets; the masks here come from rendering message by message). No ``strftime_now``:
    templates that test for it (Llama 3's) then write their fixed date, so that the tokens of an
    example do not change with the day a run (or its resume) starts."""
    import jinja2
    import jinja2.ext
    import jinja2.nodes
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationBlocks(jinja2.ext.Extension):
        tags = frozenset({"generation"})

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller: Any) -> str:
            return caller()

    class BoundedEnvironment(ImmutableSandboxedEnvironment):
        intercepted_binops = frozenset({"**", "*", "+"})

        def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
            return _bounded_binop(operator, left, right)

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(
        x: Any,
        ensure_ascii: bool = False,
        indent: Any = None,
        separators: Any = None,
        sort_keys: bool = False,
    ) -> str:
        return json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    env = BoundedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[GenerationBlocks, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    return env


def render_bounded(template: Any, **context: Any) -> str:
    """``template.render(**context)`` within RENDER_MAX_LINES template lines, RENDER_MAX_SECONDS and
    RENDER_MAX_CHARS of output; raise TemplateBudget past any of them.

    Why a line tracer: a jinja2 ``for`` loop runs as a plain Python loop in the compiled template, with
    no sandbox hook per iteration; the tracer counts the compiled template's own lines only (other
    frames are not traced) and works in any thread, unlike a signal-based timeout.
    """
    import sys
    import time

    deadline = time.monotonic() + RENDER_MAX_SECONDS
    lines = 0

    def local(frame: Any, event: str, _arg: Any) -> Any:
        nonlocal lines
        if event == "line":
            lines += 1
            if lines > RENDER_MAX_LINES or (lines % 4096 == 0 and time.monotonic() > deadline):
                raise TemplateBudget(
                    f"rendering one conversation ran over {RENDER_MAX_LINES} template lines or "
                    f"{RENDER_MAX_SECONDS:g} s (nested loops?)"
                )
        return local

    def tracer(frame: Any, event: str, _arg: Any) -> Any:
        return local if event == "call" and frame.f_code.co_filename == "<template>" else None

    previous = sys.gettrace()
    sys.settrace(tracer)
    try:
        out: list[str] = []
        size = 0
        for piece in template.generate(**context):
            size += len(piece)
            if size > RENDER_MAX_CHARS:
                raise TemplateBudget(f"one conversation rendered to more than {RENDER_MAX_CHARS} characters")
            out.append(piece)
        return "".join(out)
    finally:
        sys.settrace(previous)
