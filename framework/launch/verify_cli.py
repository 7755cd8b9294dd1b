"""``python -m framework verify compare RUN_A RUN_B``: side-by-side report of two run dirs.

Its help answers before torch is imported: the comparison is imported once the arguments parsed."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m framework verify",
        description="Compare two run dirs side by side: graph, config, loss and performance.",
    )
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("compare", help="graph, config, loss and performance of two run dirs, side by side")
    p.add_argument("run_a", type=Path, help="a run dir (the reference)")
    p.add_argument("run_b", type=Path, help="a run dir to compare with it")
    p.add_argument("--out", type=Path, default=None, help="also write the report to this file")
    p.add_argument("--force", action="store_true", help="replace an --out file that compare did not write")
    args = parser.parse_args(argv)
    from framework.record.outputs import check_replaceable
    from framework.verify.compare import compare_runs

    try:
        if args.out is not None:
            check_replaceable(
                "--out", args.out, is_compare_report, "a report compare wrote", args.force, "compare.md"
            )
        text = compare_runs(args.run_a, args.run_b)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(text, end="")
    if args.out is not None:
        args.out.write_text(text)
    return 0


def is_compare_report(path: Path) -> bool:
    """Whether ``path`` holds a report compare wrote (its heading, framework.verify.compare): the only
    file --out replaces without --force."""
    from framework.record.outputs import text_of

    text = text_of(path, 64)
    return text is not None and text.startswith("# Compare\n")


if __name__ == "__main__":
    sys.exit(main())
