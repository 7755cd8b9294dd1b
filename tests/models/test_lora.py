"""LoRA (framework.models.lora, framework.parallel.lora, framework.checkpoint.export_lora) against the
``peft`` library over transformers' ``LlamaForCausalLM``: a tiny random model made here, fp32, CPU."""

from __future__ import annotations

import dataclasses
import json
import re
import subprocess
from pathlib import Path

import pytest
import torch

pytest.importorskip("peft", reason="peft is in the dev extra: the LoRA tests compare with it")

from framework.checkpoint import init_from  # noqa: E402
from framework.checkpoint.export_hf import export_hf  # noqa: E402
from framework.checkpoint.export_lora import export_adapter, to_peft_state  # noqa: E402
from framework.config.schema import Config, ModelConfig, PeftConfig, PeftMethod, Strategy  # noqa: E402
from framework.launch.rules import check as check_rules  # noqa: E402
from framework.models import (
    build_model,  # noqa: E402
    lora,  # noqa: E402
)
from framework.parallel import build_mesh, parallelize  # noqa: E402
from framework.planner.resolve import make_plan  # noqa: E402
from tests.checkpoint.test_checkpoint_import_hf import make_hf_model, tokens  # noqa: E402
from tests.checkpoint.test_init_from import resolve  # noqa: E402
from tests.dist import run_ranks  # noqa: E402

TOL = 1e-5
ROOT = Path(__file__).resolve().parents[2]
LORA = PeftConfig(method=PeftMethod.lora, rank=4, alpha=8.0, targets=["wq", "wk", "wv", "wo", "w2"])
HF_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "down_proj"]


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("hf") / "base"
    make_hf_model(out, 64, 4, 2, False, None, None)
    return out


def lora_model(base: Path, peft: PeftConfig = LORA, world: int = 1, strategy: Strategy = Strategy.ddp):
    cfg = resolve(Config(model=ModelConfig(init_from=str(base))), [])
    cfg.mesh.shape, cfg.sharding.strategy = [world], strategy
    cfg.train.seq_len, cfg.train.global_batch_size, cfg.train.micro_batch_size = 16, world, 1
    plan = make_plan(cfg)
    args = (cfg.sharding, cfg.bucketing, cfg.executor, torch.device("cpu"), 0)
    mesh = build_mesh(plan, "cpu") if world > 1 else None  # one process: no process group, no mesh
    model = parallelize(build_model(cfg.model, 16), mesh, plan, *args, peft=peft, load_weights=init_from.load)
    return cfg, model


def randomize_adapters(model: torch.nn.Module) -> None:
    """B is zero at the start (the model is the base): non-zero adapters, the same on every rank."""
    with torch.no_grad():
        for n, p in model.named_parameters():
            if lora.is_lora_name(n):
                g = torch.Generator().manual_seed(lora._seed(7, n.removeprefix("module.")))  # DDP: module.
                lora._fill(p, torch.randn(p.shape, generator=g) * 0.05)


def peft_model(base: Path, state: dict[str, torch.Tensor], model_cfg: ModelConfig):
    from peft import LoraConfig, get_peft_model, set_peft_model_state_dict
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(base).eval()
    model = get_peft_model(hf, LoraConfig(r=LORA.rank, lora_alpha=LORA.alpha, target_modules=HF_TARGETS))
    peft_state = {k.removeprefix("base_model.model."): v for k, v in to_peft_state(state, model_cfg).items()}
    result = set_peft_model_state_dict(model, {f"base_model.model.{k}": v for k, v in peft_state.items()})
    assert not result.unexpected_keys, result.unexpected_keys
    return model.eval()


def test_only_adapters_train_and_logits_equal_peft(base: Path) -> None:
    cfg, model = lora_model(base)
    trainable = sorted(n for n, p in model.named_parameters() if p.requires_grad)
    assert trainable and all(lora.is_lora_name(n) for n in trainable)
    assert len(trainable) == 2 * 5 * 2  # A and B, 5 layers a block, 2 blocks
    with torch.no_grad():
        start = model(tokens())
    randomize_adapters(model)
    state = dict(model.state_dict())
    with torch.no_grad():
        ours = model(tokens())
        theirs = peft_model(base, state, cfg.model)(tokens()).logits
    assert (ours - start).abs().max() > 1e-3  # the adapters change the logits
    assert (ours - theirs).abs().max().item() <= TOL


def test_merged_and_adapter_exports_load_in_transformers_and_peft(base: Path, tmp_path: Path) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    cfg, model = lora_model(base)
    randomize_adapters(model)
    state = dict(model.state_dict())
    with torch.no_grad():
        ours = model(tokens())
    export_hf(lora.merge(state, LORA), cfg.model, tmp_path / "merged", 64)
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    export_adapter(state, cfg.model, LORA, tmp_path / "adapter", str(base))
    written = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert written["r"] == 4 and len(written["target_modules"]) == 10
    loaded = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(base), tmp_path / "adapter"
    ).eval()
    with torch.no_grad():
        assert (merged(tokens()).logits - ours).abs().max().item() <= TOL
        assert (loaded(tokens()).logits - ours).abs().max().item() <= TOL


def test_bf16_base_keeps_fp32_adapters(base: Path) -> None:
    peft = dataclasses.replace(LORA, base_dtype=type(LORA.base_dtype).bfloat16)
    _, model = lora_model(base, peft)
    dtypes = {n: p.dtype for n, p in model.named_parameters()}
    assert all((d == torch.float32) == lora.is_lora_name(n) for n, d in dtypes.items())
    loss = model(tokens(), tokens())
    loss.backward()
    assert torch.isfinite(loss) and model.layers["0"].attention.wq.lora_A.weight.grad is not None


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            {"targets": ["wq", "no_such"]},
            "peft.targets=['wq', 'no_such'] is not valid; valid: names or fnmatch patterns of Linear layers "
            "('no_such' matches none), e.g. output, w1, w2, w3, wk, wo, wq, wv",
        ),
        ({"rank": 0}, "peft.rank=0 is not valid; valid: an integer >= 1"),
        ({"rank": 65}, "peft.rank=65 is not valid; valid: an integer >= 1 and <= 32"),
    ],
)
def test_bad_lora_settings_are_one_line(base: Path, change: dict, message: str) -> None:
    cfg = resolve(Config(model=ModelConfig(init_from=str(base))), [])
    cfg.peft = dataclasses.replace(LORA, **change)
    with pytest.raises(ValueError, match="^" + re.escape(message)) as e:
        check_rules(cfg)
    assert "\n" not in str(e.value)


def _dist_logits(rank: int, world: int, base: str, strategy: Strategy, expected: torch.Tensor) -> float:
    _, model = lora_model(Path(base), world=world, strategy=strategy)
    randomize_adapters(model)
    with torch.no_grad():
        return (model(tokens()) - expected).abs().max().item()


@pytest.mark.parametrize("strategy", [Strategy.ddp, Strategy.fsdp])
def test_ddp_and_fsdp_on_two_ranks_equal_one_process(base: Path, strategy: Strategy) -> None:
    _, model = lora_model(base)
    randomize_adapters(model)
    with torch.no_grad():
        expected = model(tokens())
    for d in run_ranks(_dist_logits, 2, str(base), strategy, expected):
        assert d <= TOL, d


FAST = [
    "train.seq_len=16",
    "train.global_batch_size=4",
    "train.log_every=1",
    "train.eval_every=0",
    "train.warmup_steps=1",
    "freeze=none",
    "logger.plot=false",
    "checkpoint=sync",
]


def _export(capfd: pytest.CaptureFixture[str], *args: str) -> subprocess.CompletedProcess:
    """``python -m framework export-hf *args``: the CLI's main in this process (tests/launch/test_cli.py
    runs ``python -m framework`` in a fresh interpreter); its exit status and output."""
    from framework import __main__ as cli

    capfd.readouterr()
    code = cli.main(["export-hf", *args])
    out = capfd.readouterr()
    return subprocess.CompletedProcess(["export-hf", *args], code, out.out, out.err)


def test_train_resume_and_both_exports_from_the_cli(
    base: Path, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """train.py with peft=lora: the checkpoint holds adapters only, a resume continues from it, and
    ``export-hf`` (merged) and ``export-hf --adapter`` load in transformers and peft with the
    framework's logits on the trained adapters."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from framework.checkpoint.export_hf import checkpoint_model_state
    from framework.checkpoint.state import read_metadata
    from tests.checkpoint.test_init_from import ok, train

    run = tmp_path / "run"
    common = [f"model.init_from={base}", "peft=lora", "peft.targets=[wq,wk,w2]", *FAST]
    ok(train(run, "train.steps=2", *common))
    step = run / "checkpoints" / "step_000002"
    saved = [k for k in read_metadata(step).state_dict_metadata if k.startswith("model.")]
    assert len(saved) == 2 * 3 * 2 and all(lora.is_lora_name(k) for k in saved)  # A, B x 3 layers x 2 blocks
    assert "resumed: from" in ok(train(run, "train.steps=3", *common))

    peft = dataclasses.replace(LORA, rank=8, alpha=16.0, targets=["wq", "wk", "w2"])
    cfg, model = lora_model(base, peft)
    adapters = checkpoint_model_state(run / "checkpoints" / "step_000003")
    assert model.load_state_dict(adapters, strict=False).unexpected_keys == []
    assert adapters["layers.0.attention.wq.lora_B.weight"].abs().max() > 0  # it trained
    with torch.no_grad():
        ours = model(tokens())
    assert _export(capfd, str(run), str(tmp_path / "merged")).returncode == 0
    proc = _export(capfd, str(run), str(tmp_path / "adapter"), "--adapter")
    assert proc.returncode == 0, proc.stderr[-2000:]
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    loaded = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(base), tmp_path / "adapter"
    ).eval()
    with torch.no_grad():
        assert (merged(tokens()).logits - ours).abs().max().item() <= TOL
        assert (loaded(tokens()).logits - ours).abs().max().item() <= TOL
    # Not a LoRA run, or over a folder export-hf did not write: one line, exit 2, nothing written.
    other = tmp_path / "other"
    other.mkdir()
    (other / "keep.txt").write_text("mine")
    refused = _export(capfd, str(run), str(other), "--adapter")
    assert refused.returncode == 2 and len(refused.stderr.strip().splitlines()) == 1, refused.stderr
    assert sorted(p.name for p in other.iterdir()) == ["keep.txt"]


def test_an_adapter_folder_starts_the_adapters(base: Path, tmp_path: Path) -> None:
    """peft.adapter=FOLDER (export-hf --adapter's, or peft's own) restores the adapters exactly."""
    cfg, model = lora_model(base)
    randomize_adapters(model)
    with torch.no_grad():
        expected = model(tokens())
    export_adapter(dict(model.state_dict()), cfg.model, LORA, tmp_path / "adapter", str(base))
    cfg.peft = dataclasses.replace(LORA, adapter=str(tmp_path / "adapter"))
    check_rules(cfg)
    _, again = lora_model(base, cfg.peft)
    with torch.no_grad():
        assert (again(tokens()) - expected).abs().max().item() == 0.0
    # Targets the folder has no adapters for: the refusal counts and names what it lacks (it ended
    # "and lacks []" when only the other side differed).
    for targets, says in ((["wq", "wk", "wv", "wo", "w2", "w1"], "it lacks 4 adapter tensors they select (e.g. "),
                          (["wq", "wk", "wv", "wo"], "it has 4 adapter tensors they do not select (e.g. ")):  # fmt: skip
        cfg.peft = dataclasses.replace(cfg.peft, targets=targets)
        with pytest.raises(ValueError, match=r"adapters on the layers peft\.targets=") as e:
            check_rules(cfg)
        assert says in str(e.value) and "[]" not in str(e.value) and " and " not in str(e.value).split("; ")[-1]


def test_an_adapter_of_another_base_is_one_line_exit_2_and_no_run_dir(base: Path, tmp_path: Path) -> None:
    other = tmp_path / "other_base"
    make_hf_model(other, 48, 4, 2, False, None, None)
    cfg = resolve(Config(model=ModelConfig(init_from=str(other))), [])
    cfg.train.seq_len = 16
    _, model = lora_model(other)
    export_adapter(dict(model.state_dict()), cfg.model, LORA, tmp_path / "adapter", str(other))
    cfg = resolve(Config(model=ModelConfig(init_from=str(base))), [])
    cfg.peft = dataclasses.replace(LORA, adapter=str(tmp_path / "adapter"))
    with pytest.raises(
        ValueError,
        match=r"^peft\.adapter=.* an adapter of this base; it was trained on .*"
        r"\(hidden_size 48 != 64\), not model\.init_from=",
    ) as e:
        check_rules(cfg)
    assert "\n" not in str(e.value)
    cfg.peft = dataclasses.replace(cfg.peft, rank=8)  # another rank: named with the adapter's
    with pytest.raises(ValueError, match=r"hidden_size 48 != 64"):
        check_rules(cfg)
    from tests.checkpoint.test_init_from import train

    run = tmp_path / "run"
    args = [f"model.init_from={base}", "peft=lora", "peft.targets=[wq,wk,wv,wo,w2]", "peft.rank=4"]
    proc = train(run, *args, "peft.alpha=8", f"peft.adapter={tmp_path / 'adapter'}", "train.steps=1", *FAST)
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = [ln for ln in proc.stderr.strip().splitlines() if ln.strip()]
    assert len(lines) == 1 and "hidden_size 48 != 64" in lines[0], proc.stderr[-2000:]
    assert not run.exists()


def _spoil(folder: Path, how: str) -> str:
    """Spoil an exported adapter folder one way; the refusal's words for it."""
    from safetensors.torch import load_file, save_file

    weights = folder / lora.ADAPTER_WEIGHTS
    tensors = load_file(str(weights))
    first = sorted(tensors)[0]
    if how in ("nan", "inf"):
        tensors[first] = torch.full_like(tensors[first], float(how))
        save_file(tensors, str(weights))
        return f"valid: finite adapter weights; {first} holds NaN or inf"
    if how == "int64":
        save_file({k: v.to(torch.int64) for k, v in tensors.items()}, str(weights))
        return f"of floating-point weights (F16, BF16, F32, F64); {first} is I64"
    if how in ("list", "string"):
        (folder / lora.ADAPTER_CONFIG).write_text("[1, 2]" if how == "list" else '"lora"')
        return f"its adapter_config.json holds a {'list' if how == 'list' else 'str'}, not an object"
    raw = weights.read_bytes()
    huge = (2**40).to_bytes(8, "little") + raw[8:]  # the header's length: past safetensors' limit
    weights.write_bytes(raw[: len(raw) // 2] if how == "truncated" else huge)
    return "its adapter_model.safetensors is not a readable safetensors file (Error while deserializing header"


@pytest.mark.parametrize("how", ["nan", "inf", "int64", "list", "string", "truncated", "huge header"])
def test_a_spoiled_adapter_folder_is_refused_in_one_line(base: Path, tmp_path: Path, how: str) -> None:
    """NaN, inf or integer adapter weights were accepted (with NaN every step was skipped and the run
    exited 0); an adapter_config.json that is a list or a string, a truncated weights file or one
    whose header claims a terabyte were tracebacks."""
    cfg, model = lora_model(base)
    randomize_adapters(model)
    export_adapter(dict(model.state_dict()), cfg.model, LORA, tmp_path / "adapter", str(base))
    words = _spoil(tmp_path / "adapter", how)
    cfg.peft = dataclasses.replace(LORA, adapter=str(tmp_path / "adapter"))
    with pytest.raises(ValueError, match=r"^peft\.adapter=.* is not valid; valid: ") as e:
        check_rules(cfg)
    assert words in str(e.value) and "\n" not in str(e.value), str(e.value)


def _losses(run: Path) -> list[float]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows if "loss" in r]


def test_pipeline_and_fsdp_on_two_ranks_train_like_one_process_and_tp_is_refused(tmp_path: Path) -> None:
    """pp=2 and FSDP (adapters sharded beside frozen weights) for 3 steps (the default tied llama_tiny: its frozen tied embedding has no gradient to reduce across
    stages) gives one process's losses; tp=2 is refused in one line, exit 2, no run dir.

    The two-rank runs are their config as train.py composes it, trained on 2 ranks forked from this
    process (tests/dist.py: what a launched rank runs, without 2 interpreters importing torch; the
    launch of ranks plays no part in the claim). The refusal goes through train.py."""
    from tests.checkpoint.test_init_from import ok, train
    from tests.dist import train_on_forked_ranks

    fast = [*FAST[:-1], "peft=lora", "train.steps=3"]
    ok(train(tmp_path / "one", *fast))
    for name, layout in (("pp", ["parallel.pp=2", "parallel.dp_shard=1"]), ("fsdp", ["sharding=fsdp"])):
        train_on_forked_ranks(tmp_path / name, 2, "mesh=2", *layout, *fast)
    one, pp, fsdp = _losses(tmp_path / "one"), _losses(tmp_path / "pp"), _losses(tmp_path / "fsdp")
    assert len(one) == 3 and one == pytest.approx(pp, rel=1e-5) and one == pytest.approx(fsdp, rel=1e-5)
    proc = train(tmp_path / "tp", "mesh=2", "sharding=tp", *fast)
    assert proc.returncode == 2 and not (tmp_path / "tp").exists()
    assert "peft.method=lora with tp=2: not supported; valid: tp=1" in proc.stderr.strip().splitlines()[-1]


def test_dropout_masks_follow_train_seed_not_the_launching_process(tmp_path: Path) -> None:
    """peft.dropout draws from the global RNG, which torch seeds at random per process: two runs of one
    config, forked from parents in different RNG states, train the same (train.seed seeds each rank)."""
    from tests.checkpoint.test_init_from import ok, train

    fast = [*FAST[:-1], "peft=lora", "peft.dropout=0.5", "train.steps=3"]
    runs = {}
    for name, parent_seed in (("a", 1), ("b", 2)):
        torch.manual_seed(parent_seed)
        ok(train(tmp_path / name, *fast))
        runs[name] = _losses(tmp_path / name)
    assert len(runs["a"]) == 3 and runs["a"] == runs["b"]
