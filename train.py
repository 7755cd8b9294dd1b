"""Entry point: ``python train.py [group=option ...] [key=value ...]``.

Reads like a table of contents: compose (Hydra) -> validate and plan -> launch ranks -> each rank
builds, freezes, parallelizes, trains, checkpoints and verifies (framework.trainer).
"""

import sys

import hydra
from omegaconf import DictConfig

from framework import config, docs, recipes
from framework.launch import arm_stack_dump, register_resolvers
from framework.override_errors import one_line_errors

config.register()
try:
    recipes.register()  # a missing recipe root or a recipe that is not valid YAML: one line, exit 2
except ValueError as e:
    print(f"error: {e}", file=sys.stderr)
    sys.exit(2)
register_resolvers()
arm_stack_dump()  # FRAMEWORK_STACK_DUMP_S: where a stuck run was (tests set it)
sys.argv = config.quote_numeric_choices(sys.argv)
sys.argv = docs.full_help_flag(sys.argv)  # --help --all: the help with the composed config


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg: DictConfig) -> float | None:
    from framework.entry import run_job

    return run_job(cfg)


if __name__ == "__main__":
    with one_line_errors(sys.argv):  # an override Hydra rejects: one line, exit 2 (framework.override_errors)
        main()
