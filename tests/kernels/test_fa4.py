"""``model.attention=fa4``: the refusals before launch, on the CPU; the kernels themselves run on a
Hopper GPU with flash-attn-4 installed (benchmarks/fa4_check.py: parity with SDPA, eager and
compiled)."""

from __future__ import annotations

import dataclasses
import importlib
import logging
import sys
from pathlib import Path

import pytest
import torch

from framework.config.schema import AttentionBackend, Config
from framework.kernels import fa4
from framework.launch.prelaunch import check_fa4
from framework.models import model_spec
from framework.models.parts.attention import _SDPA_BACKENDS
from framework.planner import search, search_space
from tests.config.test_config import compose_config
from tests.data.test_data_pipeline import train_main
from tests.kernels.test_target import on

H100 = (9, 0)


def fa4_cfg(*overrides: str) -> Config:
    return compose_config("recipe=llama_tiny", "model.attention=fa4", *overrides)


def refused(cfg: Config, capability: tuple[int, int] | None, *fragments: str, device: str = "cuda") -> None:
    with pytest.raises(ValueError) as e:
        name = "NVIDIA A100" if capability == (8, 0) else "NVIDIA H100"
        fa4.check(cfg.model, cfg.parallel.cp, device, capability, name, head_dim=model_spec(cfg.model).head_dim)
    message = str(e.value)
    assert "\n" not in message and message.startswith("model.attention=fa4"), message
    for f in fragments:
        assert f in message, message


def test_refused_off_hopper_and_blackwell() -> None:
    refused(fa4_cfg(), None, "needs a CUDA GPU", "uses cpu", "model.attention=auto", device="cpu")
    refused(fa4_cfg(), (8, 0), "NVIDIA A100 is 8.0", "model.attention=auto")
    refused(fa4_cfg(), (12, 0), "is 12.0")


def test_refused_head_sizes_and_context_parallelism() -> None:
    # llama_tiny's heads are dim / n_heads = 32: a size FA4 has. 12 is not a multiple of 8.
    refused(fa4_cfg("model.head_dim=12"), H100, "head size 12", "8-256")
    refused(fa4_cfg("model.head_dim=192"), (10, 0), "head size 192", "8-128 or 256")
    assert fa4.head_dim_supported(9, 192) and fa4.head_dim_supported(10, 256)
    refused(fa4_cfg("parallel.cp=2"), H100, "parallel.cp=2", "context parallelism")


def budget(cfg: Config, gqa_counted: bool) -> None:
    fa4.check_budget(cfg.model, cfg.sharding.activation_checkpointing, cfg.data.document_mask, gqa_counted)


def test_registry_and_package() -> None:
    """This torch (>= 2.11) has the registry and its FA4 glue; flash-attn-4 is not installed here
    (its CuTe DSL libraries are GPU-only), so a Hopper launch is refused for the package."""
    assert fa4.registry_has_fa4()
    if fa4.installed():
        model = fa4_cfg().model
        fa4.check(model, 1, "cuda", H100, "NVIDIA H100", head_dim=model_spec(model).head_dim)
    else:
        refused(fa4_cfg(), H100, "needs the flash-attn-4 package", "pip install")


def test_registers_itself_in_torchs_registry() -> None:
    """torch's FA4 glue, registered under this module's name with this module as the kernels."""
    attention = torch.nn.attention
    try:
        fa4.register()
        fa4.register()  # once per process: the second call changes nothing
        assert attention.current_flash_attention_impl() == fa4.IMPL
        assert attention.list_flash_attention_impls().count(fa4.IMPL) == 1
        assert torch.nn.attention._fa4._FA4_MODULE_PATH == "framework.kernels.fa4"
    finally:
        attention.restore_flash_attention_impl()
    assert attention.current_flash_attention_impl() is None


def test_registry_missing_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """A torch older than 2.11 has no ``activate_flash_attention_impl``."""
    monkeypatch.delattr(torch.nn.attention, "activate_flash_attention_impl")
    refused(fa4_cfg(), H100, "torch's flash-attention registry", torch.__version__)


def test_dry_run_checks_the_declared_hardware(caplog: pytest.LogCaptureFixture) -> None:
    """A dry run on this CPU host plans fa4 for a Hopper profile (no kernel runs: without the
    package it warns in one line), refuses it for an A100 profile or a head size sm90 lacks."""
    cpu, cfg = torch.device("cpu"), fa4_cfg()
    with caplog.at_level(logging.WARNING, logger="framework"):
        check_fa4(on(cfg, "h100_sxm"), cpu)
    warnings = [r.getMessage() for r in caplog.records]
    if fa4.installed():
        assert warnings == []
    else:
        assert len(warnings) == 1 and "needs the flash-attn-4 package" in warnings[0], warnings
    with pytest.raises(ValueError, match=r"mesh.hardware.name=a100_80gb is 8.0: use model.attention=auto$"):
        check_fa4(on(cfg, "a100_80gb"), cpu)
    with pytest.raises(ValueError, match="head size 12"):
        check_fa4(on(fa4_cfg("model.head_dim=12"), "h200"), cpu)
    with pytest.raises(ValueError, match="uses cpu"):  # a launch checks this host's device
        check_fa4(on(cfg, "h100_sxm", dry_run=False), cpu)


def test_other_backends_are_never_refused() -> None:
    cfg = fa4_cfg()
    for backend in AttentionBackend:
        if backend is not AttentionBackend.fa4:
            other = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, attention=backend))
            head_dim = model_spec(other.model).head_dim
            fa4.check(other.model, other.parallel.cp, "cpu", None, "cpu", head_dim=head_dim)


def test_fa4_runs_sdpa_flash_and_context_parallelism_is_not_searched() -> None:
    from torch.nn.attention import SDPBackend

    assert _SDPA_BACKENDS[AttentionBackend.fa4] is SDPBackend.FLASH_ATTENTION
    long = compose_config("recipe=llama1b", "train.seq_len=65536", "run.device=cuda", "mesh/hardware=h200")
    assert search_space.cp_options(long, 8) != [1]
    with_fa4 = dataclasses.replace(
        long, model=dataclasses.replace(long.model, attention=AttentionBackend.fa4)
    )
    assert search_space.cp_options(with_fa4, 8) == [1]


def test_train_py_refuses_it_on_cpu(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = tmp_path / "run"
    with pytest.raises(SystemExit) as e:
        train_main(run, "run.device=cpu", "model.attention=fa4")
    assert e.value.code == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "model.attention=fa4 needs a CUDA GPU" in errors[0], errors
    assert not run.exists()


def _site(root: Path, *files: str) -> Path:
    """A site folder holding empty ``files`` (the installed layout that ``fa4.missing`` looks up)."""
    for f in files:
        (root / f).parent.mkdir(parents=True, exist_ok=True)
        (root / f).write_text("")
    return root


@pytest.mark.parametrize(
    ("files", "lacking"),
    [
        ((), "flash-attn-4"),
        (("flash_attn/cute/interface.py",), "nvidia-cutlass-dsl"),
        # libs-base alone: the DSL's compiled half, no cutlass/__init__.py nor cutlass/cute
        (
            ("flash_attn/cute/interface.py", "nvidia_cutlass_dsl/__init__.py", "cutlass/_mlir/ir.py"),
            fa4.CUTE_PIP_NAME,
        ),
        (
            (
                "flash_attn/cute/interface.py",
                "nvidia_cutlass_dsl/__init__.py",
                "cutlass/__init__.py",
                "cutlass/cute/__init__.py",
            ),
            None,
        ),
    ],
)
def test_missing_names_the_part_of_the_install_that_is_absent(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, files: tuple[str, ...], lacking: str | None
) -> None:
    """Each of flash-attn-4's parts is looked up without an import; the CuTe DSL's Python half
    (nvidia-cutlass-dsl-libs-core's ``cutlass.cute``) too, which the first check missed (a broken
    install then failed inside the rank). The refusal names the package to install."""
    for name in ("flash_attn", "nvidia_cutlass_dsl", "cutlass"):
        assert name not in sys.modules  # find_spec would answer from sys.modules
    monkeypatch.syspath_prepend(str(_site(tmp_path, *files)))
    importlib.invalidate_caches()
    assert fa4.missing() == lacking
    if lacking == fa4.CUTE_PIP_NAME:
        refused(fa4_cfg(), H100, "cutlass.cute", fa4.CUTE_PIP_NAME, "dsl_packages")
    elif lacking is not None:
        refused(fa4_cfg(), H100, f"needs the {lacking} package")


@pytest.mark.parametrize("attention", [AttentionBackend.flash, AttentionBackend.fa4])
def test_budget_is_refused_and_not_searched_where_torch_cannot_count_gqa_flash(
    attention: AttentionBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """torch 2.11's flop counter rejects the flash op with GQA, and the budget's partitioner uses it
    (the 8B's compile failed on the H200: benchmarks/PERF.md, session 14). Where it cannot count,
    a user's budget is refused and sharding=auto leaves budget out; a document mask (the
    variable-length op), MHA, another kernel, or a torch that counts it (2.13's) pass."""
    common = ("recipe=llama3_8b", "run.device=cuda", "mesh/hardware=h200", "executor=compile",
              "train.seq_len=8192", "train.global_batch_size=1", "train.micro_batch_size=1")  # fmt: skip
    cfg = compose_config(*common, f"model.attention={attention.value}", "sharding.activation_checkpointing=budget")
    budget(cfg, gqa_counted=True)
    line = rf"^model.attention={attention.value} with sharding.activation_checkpointing=budget: torch .* rejects"
    with pytest.raises(ValueError, match=line + r" the flash kernel with 8 key/value heads for 32 query heads"):
        budget(cfg, gqa_counted=False)
    masked = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, document_mask=True))
    budget(masked, gqa_counted=False)
    auto = compose_config(*common, "sharding.activation_checkpointing=budget")
    budget(auto, gqa_counted=False)
    # The search: a torch that cannot count it (2.11's, which this host's torch is not) skips budget.
    free = compose_config(*common, f"model.attention={attention.value}", "sharding=auto")
    assert search._searches_budget(free) == fa4.flop_counter_takes_gqa()
    monkeypatch.setattr(fa4, "flop_counter_takes_gqa", lambda: False)
    assert not search._searches_budget(free) and not search._budget_compiles(cfg)
    assert search._budget_compiles(masked)
