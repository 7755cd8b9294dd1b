"""Shared fixtures. Multi-rank helpers live in tests/dist.py."""

import os

# Keep each test process on one intra-op thread: CI has 2 cores and tests start several ranks.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")
