"""One entry point for every tool: ``python -m framework COMMAND ...`` (console script ``framework``).

Each command hands the rest of the command line to an existing tool's ``main`` unchanged, so
``python -m framework.generate ...`` and ``python -m framework generate ...`` are the same call.
The tools are named by dotted strings in ``COMMANDS`` only: moving a module rewrites one string here.
"""

from __future__ import annotations

import importlib
import runpy
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# command -> (the tool's module, or "train.py" for training; argv put before the user's; one line)
COMMANDS: dict[str, tuple[str, list[str], str]] = {
    "train": ("train.py", [], "train a model: GROUP=OPTION and KEY=VALUE overrides, as python train.py"),
    "evaluate": (
        "framework.launch.evaluate",
        [],
        "loss, perplexity and tokens of a run dir, checkpoint or HF folder on a data set (JSON report)",
    ),
    "generate": ("framework.launch.generate", [], "sample text from a run dir, checkpoint or HF folder"),
    "export-hf": ("framework.launch.export_cli", ["export-hf"], "a checkpoint -> a Hugging Face folder"),
    "data": ("framework.launch.data_cli", [], "prepare token files, train a BPE tokenizer"),
    "recipes": (
        "framework.launch.recipe_cli",
        [],
        "list, show and check recipes (shipped and FRAMEWORK_RECIPE_PATH)",
    ),
    "verify": ("framework.launch.verify_cli", [], "compare two run dirs side by side"),
    "docs": ("framework.launch.docs", [], "regenerate (or --check) docs/config.md and the --help text"),
}


def usage() -> str:
    width = max(len(c) for c in COMMANDS) + 2
    lines = [f"  {c:<{width}}{d}" for c, (_, _, d) in COMMANDS.items()]
    return "\n".join(
        [
            "usage: python -m framework COMMAND [ARGS ...]   (or: framework COMMAND ...)",
            "",
            "commands:",
            *lines,
            "",
            "python -m framework COMMAND --help: that command's options.",
        ]
    )


def run_train(argv: list[str]) -> int:
    """train.py as its own script (Hydra finds conf/ beside it; ranks relaunch it by sys.argv[0])."""
    script = ROOT / "train.py"
    if not script.is_file():
        print(f"error: {script} not found: `framework train` runs from a source checkout", file=sys.stderr)
        return 2
    sys.argv = [str(script), *argv]
    try:
        runpy.run_path(str(script), run_name="__main__")
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    return 0


def main(argv: list[str] | None = None) -> int:
    from framework.launch.startup import one_line_interrupts

    one_line_interrupts()  # Ctrl-C anywhere in any command: one line, not a traceback
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command not in COMMANDS:
        print(f"error: unknown command {command!r}; valid: {', '.join(COMMANDS)}", file=sys.stderr)
        return 2
    target, prefix, _ = COMMANDS[command]
    if target == "train.py":
        return run_train(rest)
    code = importlib.import_module(target).main([*prefix, *rest])
    return int(code or 0)


if __name__ == "__main__":
    sys.exit(main())
