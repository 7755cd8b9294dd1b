"""``python -m framework recipes list | validate NAME``: the recipe roots, and a recipe checked as
``train.py`` checks it.

``validate`` composes the recipe and runs the launcher's own checks (framework.launch.prelaunch.prelaunch:
the safety of the composed result, every key's rule, the callbacks built once, the data, the mesh,
the plan) as a dry run would, so "valid" means ``train.py recipe=NAME run.dry_run=true`` starts:
a layout over the device memory is reported, not refused. It lives apart from the registry
(framework.launch.recipes) because it reads the launcher, which reads the registry.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from hydra.errors import HydraException
from omegaconf.errors import OmegaConfBaseException

from framework.launch.recipes import REFUSED, compose_nodes, discover, register


def _cmd_list() -> int:
    register()
    recipes = discover()
    width = max(len(n) for n in recipes)
    for r in recipes.values():
        state = f"  [REFUSED: {REFUSED[r.name].split(': ', 1)[1]}]" if r.name in REFUSED else ""
        print(f"{r.name:<{width}}  {r.description or '(no description)'}  <- {r.path}{state}")
    return 0


def _check(name: str, overrides: list[str]) -> str:
    """The plan of ``recipe=NAME`` after every check train.py runs before launch (as a dry run);
    raises what train.py would refuse (RecipeRefused for an unsafe composed result)."""
    from framework.launch.prelaunch import check_safe, prelaunch_with_search
    from framework.launch.recipes import RecipeRefused
    from framework.planner.report import format_plan

    task, hydra_cfg = compose_nodes(name, [*overrides, "run.dry_run=true"])
    try:
        check_safe(task, name, hydra_cfg)
    except ValueError as e:
        raise RecipeRefused(str(e)) from None
    with tempfile.TemporaryDirectory(prefix="recipe-validate-") as run_dir:  # anchors nothing it keeps
        _, plan, _, _ = prelaunch_with_search(task, Path(run_dir), name, hydra_cfg)
    return format_plan(plan)


def _cmd_validate(name: str, overrides: list[str]) -> int:
    from framework.launch.recipes import RecipeRefused

    recipes = discover()
    if name not in recipes:
        print(f"error: no recipe {name!r}; known: {sorted(recipes)}", file=sys.stderr)
        return 2
    register()
    if name in REFUSED:  # unsafe: a bad input, as for train.py
        print(f"error: {REFUSED[name]}", file=sys.stderr)
        return 2
    try:
        plan = _check(name, overrides)
    except RecipeRefused as e:
        print(f"error: recipe {name!r} ({recipes[name].path}) is refused: {e}", file=sys.stderr)
        return 2
    except (ValueError, OmegaConfBaseException, HydraException) as e:  # bad input, as train.py says it
        print(
            f"error: recipe {name!r} ({recipes[name].path}) is invalid: {_one_line(e, overrides)}",
            file=sys.stderr,
        )
        return 2
    except Exception as e:  # noqa: BLE001 - not the input: the validator itself failed
        print(
            f"error: validating recipe {name!r} failed inside the framework ({type(e).__name__}: "
            f"{_one_line(e, overrides)}); this is a bug, not your recipe",
            file=sys.stderr,
        )
        return 1
    print(f"recipe {name} ({recipes[name].path}, sha256 {recipes[name].sha256[:12]}): valid")
    print(plan)
    return 0


def _one_line(e: BaseException, overrides: list[str]) -> str:
    """A compose error as train.py words it (framework.config.override_errors), else the first line."""
    from framework.config.override_errors import explain

    line = explain(e, overrides) if isinstance(e, (HydraException, ValueError)) else None
    return line or (str(e).strip().splitlines() or [type(e).__name__])[0]


EXIT_CODES = (
    "exit status: 0 valid (the plan is printed); 2 a bad input: no such recipe, a refused (unsafe) "
    "recipe, an override or value that train.py would refuse, one line on stderr; 1 the validator "
    "itself failed (a bug)"
)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m framework recipes", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    sub.add_parser("list", help="every recipe with its source and one-line description")
    val = sub.add_parser(
        "validate",
        help="compose a recipe, check it as train.py does, dry-run its plan (exit 0 valid, 2 invalid)",
        description="Compose a recipe with the overrides, run every check train.py runs, dry-run its plan.",
        epilog=EXIT_CODES,
    )
    val.add_argument("name")
    val.add_argument("overrides", nargs="*", help="extra overrides, e.g. mesh=8 sharding=fsdp")
    args = parser.parse_args(argv)
    try:
        return _cmd_list() if args.cmd == "list" else _cmd_validate(args.name, args.overrides)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
