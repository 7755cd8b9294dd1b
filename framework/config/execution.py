"""The ``freeze``, ``peft`` and ``executor`` groups' schemas: the static graph, the trained adapters and
how the model executes (eager, compiled, CUDA graphs).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Optional

from framework.config.options import only_with
from framework.config.parallel import DType


class FreezeMode(Enum):
    none = "none"
    export = "export"
    script = "script"
    trace = "trace"


class ExecutorMode(Enum):
    eager = "eager"
    compile = "compile"
    cudagraphs = "cudagraphs"


class CompileScope(Enum):
    block = "block"
    model = "model"


class PeftMethod(Enum):
    """Parameter-efficient fine-tuning (the ``peft`` group): none trains every weight."""

    none = "none"
    lora = "lora"


@dataclass
class FreezeConfig:
    """Static graph (framework.freeze): torch.export artifact, or legacy TorchScript (script/trace)."""

    # export: what `python train.py` composes (conf/config.yaml `freeze: export`); the schema agrees.
    mode: FreezeMode = FreezeMode.export
    # torch.export.export(strict=...): trace with Dynamo instead of running Python.
    strict: bool = only_with("freeze.mode", FreezeMode.export, default=False)
    # Also trace the model as torch.compile(fullgraph=True) does (and where that breaks, run it once
    # under torch._dynamo.explain to list every break), so they are reported at freeze time.
    check_graph_breaks: bool = only_with("freeze.mode", FreezeMode.export, default=True)
    # script only: submodule paths ("layers.0.feed_forward") or methods ("helper", "layers.0.attention.fn")
    # left as Python, as @torch.jit.ignore does. Such a module runs but cannot be saved.
    ignore: list[str] = only_with("freeze.mode", FreezeMode.script, factory=list)
    # script only: extra methods compiled (and kept by torch.jit.freeze), as @torch.jit.export does.
    export_methods: list[str] = only_with("freeze.mode", FreezeMode.script, factory=list)


@dataclass
class PeftConfig:
    """LoRA (Hu et al. 2021): each targeted Linear keeps its weight W frozen and learns
    W + (alpha / rank) * B @ A, with A (rank x in) and B (out x rank, zero at the start)."""

    # none: full fine-tuning; lora: frozen base, adapters (framework.models.lora).
    method: PeftMethod = PeftMethod.none
    # The adapters' rank r: 1 .. the smallest in/out size of a targeted layer.
    rank: int = only_with("peft.method", PeftMethod.lora, default=8)
    # The update is scaled by alpha / rank (peft's lora_alpha).
    alpha: float = only_with("peft.method", PeftMethod.lora, default=16.0)
    # nn.Dropout on the adapter's input (peft's lora_dropout); the frozen path sees the plain input.
    dropout: float = only_with("peft.method", PeftMethod.lora, default=0.0)
    # Module-name patterns (fnmatch) matched against the full name ("layers.*.attention.wq") or its
    # last part ("wq"); every pattern must match at least one Linear. peft's Llama default: q and v.
    targets: list[str] = only_with("peft.method", PeftMethod.lora, factory=lambda: ["wq", "wv"])
    # The frozen weights' dtype: bfloat16 halves their memory (the adapters stay float32).
    base_dtype: DType = only_with("peft.method", PeftMethod.lora, default=DType.float32)
    # A PEFT adapter folder (adapter_config.json + adapter_model.safetensors, e.g. export-hf --adapter)
    # to start the adapters from, instead of B = 0; its base, rank, alpha and layers must be this run's.
    adapter: Optional[str] = only_with("peft.method", PeftMethod.lora, default=None)


_COMPILED = (ExecutorMode.compile, ExecutorMode.cudagraphs)


@dataclass
class ExecutorConfig:
    mode: ExecutorMode = ExecutorMode.eager
    # compile and cudagraphs: compile each block, or the whole model; torch.compile's backend.
    scope: CompileScope = only_with("executor.mode", *_COMPILED, default=CompileScope.block)
    backend: str = only_with("executor.mode", *_COMPILED, default="inductor")
    # executor.scope=block: also compile the loss head (final norm, output projection, fp32
    # cross-entropy) as its own region (framework.parallel.compile); false leaves it eager, as
    # torchtitan ran it at the end of 2024 (its loss_fn compile commented out), at 4x the head's
    # memory-bound time and 10 bytes kept per logit instead of 2 (framework.planner).
    compile_loss: bool = only_with("executor.mode", *_COMPILED, default=True)
    warmup_steps: int = 3
    # Inductor's max-autotune: benchmark GEMM/conv kernel choices at compile time (minutes longer
    # to compile; mode="max-autotune-no-cudagraphs", or "max-autotune" with cudagraphs).
    autotune: bool = only_with("executor.mode", *_COMPILED, default=False)
    # A portable compile cache (torch.compiler cache artifacts) in a directory, e.g. on shared
    # storage next to the checkpoints: loaded by every rank before compiling, extended by rank 0
    # after training, so a fresh node starts warm (framework.train.compile_cache). None = off.
    cache_dir: Optional[str] = only_with("executor.mode", *_COMPILED, default=None)
