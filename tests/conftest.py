"""Shared fixtures. Multi-rank helpers live in tests/dist.py."""

import os

# Keep each test process on one intra-op thread: CI has 2 cores and tests start several ranks.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")
# A run the suite launches that is still going after 150 s dumps its threads' stacks to its stderr
# (framework.launch.ranks.arm_stack_dump); a test killing it at its timeout then shows where it hung.
os.environ.setdefault("FRAMEWORK_STACK_DUMP_S", "150")


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
