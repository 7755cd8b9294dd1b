"""Entry point: ``python train.py [group=option ...] [key=value ...]``.

Reads like a table of contents: compose (Hydra) -> validate and plan -> launch ranks -> each rank
builds, freezes, parallelizes, trains, checkpoints and verifies (framework.train.trainer).
"""

import sys

from framework.launch.startup import (
    arm_stack_dump,
    one_line_interrupts,
    one_line_warnings,
    register_resolvers,
)

one_line_interrupts()  # Ctrl-C anywhere (an import, the freeze): one line, not a traceback
one_line_warnings()  # a Python warning: one line, without its source line

import hydra
from omegaconf import DictConfig

from framework.config import schema as config
from framework.config.mode_probe import skip_mode_probe
from framework.config.override_errors import one_line_errors
from framework.launch import docs, recipes

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
    from framework.launch.early_check import refuse_early

    refuse_early(cfg)  # a key's own rule refuses it: one line before the launcher imports torch
    from framework.launch.entry import run_job

    return run_job(cfg)


if __name__ == "__main__":
    # an override Hydra rejects: one line, exit 2 (framework.config.override_errors); --help: one
    # copy of Hydra's config repository for all its listings (framework.launch.docs); one
    # composition per launch, not Hydra's mode probe and then the run's (framework.config.mode_probe)
    with one_line_errors(sys.argv), docs.one_repository_for_help(sys.argv), skip_mode_probe(sys.argv):
        main()
