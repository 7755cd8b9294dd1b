"""Shared fixtures. Multi-rank helpers live in tests/dist.py."""

import os

# Keep each test process on one intra-op thread: CI has 2 cores and tests start several ranks.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")
# A run the suite launches that is still going after 150 s dumps its threads' stacks to its stderr
# (framework.launch.ranks.arm_stack_dump); a test killing it at its timeout then shows where it hung.
os.environ.setdefault("FRAMEWORK_STACK_DUMP_S", "150")


# ``pytest -m smoke``: the quick check (README), under 2 minutes on 2 cores: a few tests of each layer,
# one real ``python train.py`` run (its run dir, the loss against a plain torch loop, generate),
# two ranks against one, a checkpoint round trip, the fallback ladder's decisions, the docs' freshness.
# Test ids (a file, a test, or one parametrized case); an id that selects nothing fails tests/test_suite.py.
SMOKE = [
    "tests/test_structure.py::test_imports_only_run_down_the_layers",
    "tests/test_structure.py::test_tests_mirror_the_layers",
    "tests/test_docs.py::test_config_reference_help_and_output_blocks_are_not_stale",
    "tests/test_docs.py::test_readme_opens_with_the_two_commands_and_links_pages_that_exist",
    "tests/config/test_config.py::test_default_recipe_and_typed_values",
    "tests/config/test_config.py::test_command_line_beats_recipe",
    "tests/config/test_override_errors.py::test_rejected_value_is_one_line_naming_it_and_what_is_valid",
    "tests/record/test_metrics.py::test_every_training_line_says_step_of_total_elapsed_and_eta",
    "tests/models/test_model.py::test_document_mask_stops_attention_at_eos",
    "tests/data/test_data.py::test_ranks_split_the_same_global_batch",
    "tests/planner/test_plan.py::test_memory_estimate_components",
    "tests/freeze/test_freeze.py::test_llama_exports_and_matches_eager",
    "tests/parallel/test_parallel.py::test_matches_single_process[ddp-2]",
    "tests/checkpoint/test_checkpoint_store.py::test_load_roundtrip_and_resume_resolution",
    "tests/verify/test_verify.py::test_ladder",
    "tests/generate/test_generate.py::test_greedy_generation_equals_argmax_of_the_full_forward",
    "tests/launch/test_cli.py::test_each_tool_command_reaches_its_tools_own_parser",
    "tests/launch/test_dry_run.py::test_report_and_refusals",
    "tests/train/test_train.py::test_default_recipe_trains_and_writes_its_run_dir",
]


def pytest_collection_modifyitems(config, items):  # noqa: ANN001, ANN201 - pytest's hook signature
    """Mark the ``SMOKE`` tests ``smoke`` (a marker in one place, not spread over the files)."""
    import pytest

    for item in items:
        if any(item.nodeid == s or item.nodeid.startswith((f"{s}::", f"{s}[")) for s in SMOKE):
            item.add_marker(pytest.mark.smoke)


def pytest_configure(config):  # noqa: ANN001, ANN201 - pytest's hook signature
    """SIGTERM (a CI job cancelled, ``kill``, ``timeout``) stops the suite as Ctrl-C does: pytest
    unwinds, tears the fixtures down and ends with its summary (by default SIGTERM killed it at once
    and left its forked runs training). Then ``pytest_unconfigure`` ends what is left."""
    import signal

    def stop(signum, frame):  # noqa: ANN001, ANN202, ARG001
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, stop)


def pytest_unconfigure(config):  # noqa: ANN001, ANN201 - pytest's hook signature
    """However the session ends (done, failed, Ctrl-C, SIGTERM): the runs forked from it that are
    still going (each in a session of its own, out of reach of the terminal's Ctrl-C) are killed,
    and their ranks with them (tests/entry.py's ``kill_children``)."""
    import sys

    entry = sys.modules.get("tests.entry")
    if entry is not None:
        entry.kill_children()


def pytest_runtest_makereport(item, call):  # noqa: ANN001, ANN201 - pytest's hook signature
    """On a subprocess timeout, show the killed process's last output (stack dumps included):
    pytest's traceback would print only a truncated repr of it."""
    import subprocess

    if call.excinfo is None or not isinstance(call.excinfo.value, subprocess.TimeoutExpired):
        return
    e = call.excinfo.value
    for name, data in (("stdout", e.stdout), ("stderr", e.stderr)):
        if data:
            text = data.decode(errors="replace") if isinstance(data, bytes) else data
            item.add_report_section(call.when, f"timed-out process {name}", text[-20000:])
