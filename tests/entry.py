"""Run ``train.py``'s entry point in this process, for refusals that happen before any rank starts.

Why: a ``python train.py`` subprocess costs 4-6 s of CPU on the 2-core CI machine (a fresh
interpreter importing torch and the framework); a refusal in this process costs the compose and
the checks, well under a second. The real-process path of refusals keeps its own tests
(``tests/test_rules.py``'s end-to-end cases). Runs that train still go through a subprocess.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import torch.distributed as dist

ROOT = Path(__file__).resolve().parent.parent


def train_main(*argv: str) -> int:
    """``python train.py *argv`` in this process; returns its exit status.

    The module is loaded under the name ``__main__`` (not put in sys.modules): Hydra then finds
    ``conf/`` next to the file, and its own ``if __name__ == "__main__": main()`` runs, as
    ``python train.py`` does. The environment is restored afterwards: the entry point exports
    RUN_STAMP (and a launch would set RANK, MASTER_PORT, ...), which later tests' children and
    forked ranks would otherwise inherit; a process group it left is destroyed for the same reason.
    """
    spec = importlib.util.spec_from_file_location("__main__", ROOT / "train.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    saved_argv, saved_env, saved_cwd = sys.argv, dict(os.environ), os.getcwd()
    sys.argv = ["train.py", *argv]
    try:
        os.chdir(ROOT)
        spec.loader.exec_module(module)
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            return e.code or 0
        print(e.code, file=sys.stderr)  # what the interpreter does with a message as the exit code
        return 1
    finally:
        sys.argv = saved_argv
        os.chdir(saved_cwd)
        os.environ.clear()
        os.environ.update(saved_env)
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0
