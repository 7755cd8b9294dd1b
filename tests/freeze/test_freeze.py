"""freeze group: torch.export of the Llama, fingerprint, artifact + ABI check, pre-check, TorchScript.

No ``from __future__ import annotations`` here: TorchScript cannot resolve string annotations of an
ignored submodule ``forward`` (true of a plain ``@torch.jit.ignore`` too).
"""

import json
import re
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from torch import nn

from framework.config.schema import FreezeConfig, FreezeMode, ModelConfig
from framework.freeze import (
    ArtifactMismatchError,
    StaticGraphError,
    export_model,
    freeze,
    graph_diff,
    graph_fingerprint,
    graph_summary,
    load_artifact,
    load_fingerprint,
    save_fingerprint,
)
from framework.freeze.torchscript import script_model, ts_fingerprint
from framework.models import build_model, materialize
from tests.dist import run_ranks

CONF = Path(__file__).resolve().parents[2] / "conf" / "freeze"
SEQ = 128


def _llama(cfg: ModelConfig, seq: int = SEQ, seed: int = 0) -> nn.Module:
    model = build_model(cfg, seq)
    materialize(model, "cpu", seed)
    return model


def _tokens(cfg: ModelConfig, seq: int = SEQ) -> torch.Tensor:
    return torch.randint(0, cfg.vocab_size, (2, seq), generator=torch.Generator().manual_seed(0))


def _export_fp(cfg: ModelConfig, seq: int = SEQ, seed: int = 0, dtype: torch.dtype = torch.float32) -> list:
    model = _llama(cfg, seq, seed).to(dtype)
    return graph_summary(export_model(model, (_tokens(cfg, seq),), FreezeConfig(check_graph_breaks=False)))


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> tuple:
    cfg = ModelConfig()
    model = _llama(cfg)
    out = tmp_path_factory.mktemp("run")
    res = freeze(
        model, (_tokens(cfg),), FreezeConfig(mode=FreezeMode.export), out, manifest_extra={"run": "t"}
    )
    return model, res, out


def test_llama_exports_and_matches_eager(exported: tuple) -> None:
    model, res, _ = exported
    x = _tokens(ModelConfig())
    torch.testing.assert_close(res.program.module()(x), model(x), rtol=0, atol=0)
    assert res.fingerprint == graph_fingerprint(res.program) and len(res.fingerprint) == 64
    assert res.seconds > 0


def test_artifact_manifest_and_roundtrip(exported: tuple) -> None:
    model, res, out = exported
    frozen = out / "frozen"
    assert res.artifact == frozen and (frozen / "model.pt2").is_file()
    manifest = json.loads((frozen / "manifest.json").read_text())
    # The build's CUDA version (None on a CPU build), whether or not a GPU is present.
    assert manifest["torch"] == torch.__version__ and manifest["cuda"] == torch.version.cuda
    assert manifest["input_spec"] == [{"name": "tokens", "shape": [2, SEQ], "dtype": "torch.int64"}]
    assert manifest["num_params"] == sum(p.numel() for p in model.parameters())  # tied weight once
    assert manifest["param_dtypes"] == {"torch.float32": manifest["num_params"]}
    assert manifest["fingerprint"] == res.fingerprint and manifest["extra"] == {"run": "t"}
    ep = load_artifact(out)
    x = _tokens(ModelConfig())
    torch.testing.assert_close(ep.module()(x), model(x), rtol=0, atol=0)
    fp, summary = load_fingerprint(frozen / "fingerprint.json")
    assert fp == res.fingerprint and summary == res.summary


def _copy_artifact(src: Path, dst: Path) -> Path:
    dst.mkdir()
    for f in ("model.pt2", "manifest.json"):
        (dst / f).write_bytes((src / f).read_bytes())
    return dst


def test_load_refuses_other_torch_missing_file_and_wrong_fingerprint(exported: tuple, tmp_path: Path) -> None:
    src = exported[2] / "frozen"
    bad = _copy_artifact(src, tmp_path / "torch")
    m = json.loads((bad / "manifest.json").read_text())
    m["torch"] = "2.99.0"
    (bad / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(
        ArtifactMismatchError,
        match=rf"torch: artifact written by 2\.99\.0, running {re.escape(torch.__version__[:4])}",
    ):
        load_artifact(bad)
    fp = _copy_artifact(src, tmp_path / "fp")
    m = json.loads((fp / "manifest.json").read_text())
    m["fingerprint"] = "0" * 64
    (fp / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(ArtifactMismatchError, match="fingerprint of .* manifest says 0000"):
        load_artifact(fp)
    missing = _copy_artifact(src, tmp_path / "missing")
    (missing / "model.pt2").unlink()
    with pytest.raises(ArtifactMismatchError, match=r"missing \['model.pt2'\]"):
        load_artifact(missing)


def _rank_fingerprint(rank: int, world: int) -> str:
    # Different parameter values per rank: the fingerprint must not depend on them.
    return graph_fingerprint(
        export_model(
            _llama(ModelConfig(), seed=rank + 7),
            (_tokens(ModelConfig()),),
            FreezeConfig(check_graph_breaks=False),
        )
    )


def test_fingerprint_identical_across_processes(exported: tuple) -> None:
    fps = run_ranks(_rank_fingerprint, 2)
    assert fps == [exported[1].fingerprint] * 2


def test_fingerprint_changes_with_model_and_diff_names_node(tmp_path: Path) -> None:
    small = ModelConfig(n_layers=1)
    base = _export_fp(small, seq=32)
    variants = {
        "extra layer": _export_fp(ModelConfig(n_layers=2), seq=32),
        "seq len": _export_fp(small, seq=16),
        "dim": _export_fp(ModelConfig(n_layers=1, dim=64, ffn_dim=192), seq=32),
        "dtype": _export_fp(small, seq=32, dtype=torch.bfloat16),
    }
    for name, summary in variants.items():
        assert summary != base, name
    diff = graph_diff(base, variants["extra layer"])
    assert "first differing node #" in diff
    assert "+1 aten::scaled_dot_product_attention (1 -> 2)" in diff
    assert graph_diff(base, base) == ""
    save_fingerprint(tmp_path / "fingerprint.json", base)
    fp, loaded = load_fingerprint(tmp_path / "fingerprint.json")
    assert loaded == base and graph_diff(loaded, base) == ""


class Branchy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        if y.sum() > 0:
            return y * 2
        return y - 1


class ItemUser(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * int(x.abs().max().item())


class Dynamic(nn.Module):
    def __init__(self, with_item: bool) -> None:
        super().__init__()
        self.a = Branchy()
        self.b = nn.Sequential(nn.Linear(8, 8), Branchy())
        self.c = ItemUser() if with_item else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(self.b(self.a(x)))


def test_precheck_reports_data_dependent_branch_with_module_paths() -> None:
    with pytest.raises(StaticGraphError) as err:
        export_model(Dynamic(False), (torch.randn(4, 8),), FreezeConfig(check_graph_breaks=False))
    (issue,) = err.value.issues
    assert issue.kind == "data-dependent" and issue.module_paths == ("a", "b.1")
    assert "if y.sum() > 0:" in issue.location and "in a, b.1 at test_freeze.py" in str(err.value)


def test_precheck_lists_every_issue_including_graph_breaks() -> None:
    with pytest.raises(StaticGraphError) as err:
        export_model(Dynamic(True), (torch.randn(4, 8),), FreezeConfig(check_graph_breaks=True))
    by_line = {i.location.split("`")[1]: i for i in err.value.issues}
    assert set(by_line) == {"if y.sum() > 0:", "return x * int(x.abs().max().item())"}
    assert by_line["if y.sum() > 0:"].module_paths == ("a", "b.1")
    assert by_line["return x * int(x.abs().max().item())"].module_paths == ("c",)
    assert "2 issue(s)" in str(err.value)


class Scriptable(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.py = PythonOnly()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.py(self.lin(x)) + self.helper(x)

    def helper(self, x: torch.Tensor) -> torch.Tensor:
        return torch.from_numpy(x.detach().numpy() * 2.0)  # numpy: not TorchScript

    def extra(self, x: torch.Tensor) -> torch.Tensor:
        return x + 1


class PythonOnly(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.from_numpy(x.detach().numpy() + 1.0)


def test_script_ignore_and_export_methods() -> None:
    model, x = Scriptable(), torch.randn(2, 4)
    with (
        pytest.warns(FutureWarning, match="deprecated upstream"),
        pytest.raises(ValueError, match="cannot compile"),
    ):
        script_model(model, FreezeConfig(mode=FreezeMode.script))
    cfg = FreezeConfig(mode=FreezeMode.script, ignore=["py", "helper"], export_methods=["extra"])
    with pytest.warns(FutureWarning):
        res = freeze(model, (x,), cfg, None)
    torch.testing.assert_close(res.program(x), model(x))
    torch.testing.assert_close(res.program.extra(x), x + 1)
    assert type(model) is Scriptable and type(model.py) is PythonOnly  # markers were undone
    with pytest.warns(FutureWarning), pytest.raises(ValueError, match="cannot save"):
        freeze(model, (x,), cfg, Path("/nonexistent-not-written"))
    with (
        pytest.warns(FutureWarning),
        pytest.raises(ValueError, match="names neither a submodule nor a method"),
    ):
        script_model(model, FreezeConfig(mode=FreezeMode.script, ignore=["nope"]))


def test_script_llama_writes_frozen_ts(tmp_path: Path) -> None:
    cfg = ModelConfig(n_layers=1)
    model, x = _llama(cfg, 32), _tokens(cfg, 32)
    with pytest.warns(FutureWarning, match="freeze.mode=script"):
        res = freeze(model, (x,), FreezeConfig(mode=FreezeMode.script), tmp_path)
    torch.testing.assert_close(res.program(x), model(x))
    assert (tmp_path / "frozen" / "model.ts").is_file()
    assert load_fingerprint(tmp_path / "frozen" / "fingerprint.json")[0] == res.fingerprint
    with pytest.warns(FutureWarning):
        again = script_model(model, FreezeConfig(mode=FreezeMode.script))
    assert ts_fingerprint(again) != res.fingerprint  # not frozen: a different graph
    with pytest.warns(FutureWarning):
        third = script_model(model, FreezeConfig())
    assert ts_fingerprint(again) == ts_fingerprint(third)


def test_trace_freezes_the_llama(tmp_path: Path) -> None:
    cfg = ModelConfig(n_layers=1)
    model, x = _llama(cfg, 32), _tokens(cfg, 32)
    with pytest.warns(FutureWarning, match="freeze.mode=trace"):
        res = freeze(model, (x,), FreezeConfig(mode=FreezeMode.trace), tmp_path)
    torch.testing.assert_close(res.program(x), model(x))
    assert (tmp_path / "frozen" / "model.ts").is_file() and res.fingerprint


def test_none_and_write_false_write_nothing(tmp_path: Path) -> None:
    lin = nn.Linear(4, 4)
    res = freeze(lin, (torch.randn(2, 4),), FreezeConfig(mode=FreezeMode.none), tmp_path)
    assert res.mode == FreezeMode.none and res.fingerprint is None and res.artifact is None
    res = freeze(lin, (torch.randn(2, 4),), FreezeConfig(mode=FreezeMode.export), tmp_path, write=False)
    assert res.fingerprint is not None and res.artifact is None and list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("name", ["none", "export", "script", "trace"])
def test_shipped_freeze_configs_compose(name: str) -> None:
    merged = OmegaConf.merge(OmegaConf.structured(FreezeConfig), OmegaConf.load(CONF / f"{name}.yaml"))
    assert OmegaConf.to_object(merged).mode == FreezeMode(name)
    with pytest.raises(Exception, match="nope"):
        OmegaConf.merge(OmegaConf.structured(FreezeConfig), {"nope": 1})


def test_moe_model_freezes_on_meta_with_the_graph_break_check() -> None:
    """An MoE family on the meta device (as the trainer freezes it): torch.export traces its
    per-expert sizes as unbacked symbols, and the graph-break check traces it as
    torch.compile(fullgraph=True) does without running it (explain ran it, and on meta a per-expert
    count has no value: 'Cannot copy out of meta tensor'). The trace leaves no balance counts behind
    (the block's hook skips an export), and two freezes give one fingerprint."""
    from framework.config.schema import ModelFamily, MoEConfig, replace_model
    from framework.models.parts.sparse import sparse_layers

    cfg = replace_model(
        ModelConfig(n_layers=2, dim=64, n_heads=4, n_kv_heads=2, ffn_dim=128),
        family=ModelFamily.qwen3_moe,
        head_dim=16,
        moe=MoEConfig(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32),
    )
    fingerprints = []
    for _ in range(2):
        meta = build_model(cfg, 16)
        example = torch.zeros(2, 16, dtype=torch.long, device="meta")
        result = freeze(meta, (example,), FreezeConfig(mode=FreezeMode.export, check_graph_breaks=True), None)
        fingerprints.append(result.fingerprint)
        assert all(layer.load is None for _, layer in sparse_layers(meta))
    assert fingerprints[0] == fingerprints[1]
    unbacked = [n for n in result.program.graph.nodes if str(n.target) == "aten.item.default"]
    assert len(unbacked) == 2 * 4, unbacked  # one size per expert and layer (the per-expert loop)
