"""Fault-tolerant checkpointing on torch.distributed.checkpoint (DCP).

``Checkpointer`` (manager.py) saves and loads; ``resolve.py`` finds the checkpoint to load and
verifies it; ``store.py`` owns the on-disk layout, manifest and
retention; ``state.py`` what is saved and how it is read back safely; ``preempt.py`` signals;
``export_hf.py`` the Hugging Face export.
"""

from framework.checkpoint.export_hf import export_hf, full_model_state, to_hf_state_dict
from framework.checkpoint.manager import Checkpointer
from framework.checkpoint.preempt import PreemptionHandler
from framework.checkpoint.resolve import find_latest, resolve_resume, verify

__all__ = [
    "Checkpointer",
    "PreemptionHandler",
    "export_hf",
    "find_latest",
    "full_model_state",
    "resolve_resume",
    "to_hf_state_dict",
    "verify",
]
