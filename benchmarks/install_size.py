"""How many distributions each install of pyproject.toml pulls in (issue 44 point 9: the base install
and the extras), counted from the installed packages' own metadata in this environment (no network:
the dependency closure of each requirement list, as pip resolves it for these versions).

    python benchmarks/install_size.py [--pyproject PATH] [EXTRAS ...]   e.g. dev dev,float8 wandb

``--pyproject``: another checkout's (``git show COMMIT:pyproject.toml > /tmp/before.toml``).
"""

from __future__ import annotations

import argparse
import re
import sys
from importlib import metadata
from pathlib import Path

import tomllib
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parent.parent


def closure(requirements: list[str]) -> set[str]:
    """The installed distributions ``requirements`` need, transitively (markers evaluated, no extras)."""
    seen: set[str] = set()
    todo = [Requirement(r) for r in requirements]
    while todo:
        req = todo.pop()
        name = re.sub(r"[-_.]+", "-", req.name).lower()
        if name in seen:
            continue
        try:
            dist = metadata.distribution(req.name)
        except metadata.PackageNotFoundError:
            continue
        seen.add(name)
        for sub in dist.requires or []:
            r = Requirement(sub)
            if r.marker is None or r.marker.evaluate({"extra": ""}):
                todo.append(r)
    return seen


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("extras", nargs="*", default=["dev", "dev,float8"], help="extras, comma-joined per row")
    parser.add_argument("--pyproject", type=Path, default=ROOT / "pyproject.toml")
    args = parser.parse_args()
    project = tomllib.loads(args.pyproject.read_text())["project"]
    base, extras = project["dependencies"], project["optional-dependencies"]
    print("| install | distributions |")
    print("|---|---|")
    print(f"| `pip install -e .` | {len(closure(base))} |")
    for names in args.extras:
        reqs = base + [r for n in names.split(",") for r in extras[n]]
        print(f'| `pip install -e ".[{names}]"` | {len(closure(reqs))} |')
    return 0


if __name__ == "__main__":
    sys.exit(main())
