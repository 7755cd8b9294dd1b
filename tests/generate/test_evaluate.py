"""``python -m framework evaluate`` (framework.launch.evaluate, framework.generate.evaluate): the loss of
a Hugging Face folder, a checkpoint or a run on a data set equals transformers' loss on the same
tokens within 1e-5 (fp32, CPU); bad inputs are one line, exit 2, and write no report."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("transformers", reason="transformers is in the dev extra: the parity tests compare with its models")

from framework.data.sft import IGNORE_INDEX  # noqa: E402
from framework.generate.evaluate import batches_of, data_rows  # noqa: E402
from framework.launch.evaluate import main  # noqa: E402
from framework.launch.source import source_config  # noqa: E402
from tests.checkpoint.test_checkpoint_export_hf import make_hf_folder  # noqa: E402
from tests.corpus import ROOT  # noqa: E402

SFT = ROOT / "recipes" / "data" / "sft_tiny" / "train.jsonl"
TOL = 1e-5


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_hf_folder(tmp_path_factory.mktemp("hf") / "tiny_llama")


@pytest.fixture(scope="module")
def documents(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A jsonl of short documents drawn from the SFT conversations (words the tokenizer knows)."""
    out = tmp_path_factory.mktemp("docs") / "docs.jsonl"
    from framework.data.sft import Fields, read_records

    texts = [" ".join(m["content"] for m in msgs) for _, msgs in read_records([SFT], Fields())]
    out.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return out


def transformers_loss(folder: Path, overrides: list[str]) -> tuple[float, int]:
    """transformers' mean cross-entropy over the evaluation set's windows (the same rows the
    command scores: data_rows of the composed config) and the number of scored tokens."""
    from transformers import AutoModelForCausalLM

    cfg, _, _ = source_config(folder, overrides, evaluate_data=True)
    from framework.data.tokenizer import load_tokenizer

    rows, _ = data_rows(cfg, load_tokenizer(cfg.tokenizer))
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for x, y in batches_of(rows, 4):
            logits = model(input_ids=x).logits
            total += float(F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="sum"))
            count += int((y != IGNORE_INDEX).sum())
    return total / count, count


def evaluate(path: Path, overrides: list[str], report: Path, capsys: pytest.CaptureFixture[str]) -> dict:
    assert main([str(path), *overrides, "--report", str(report), "--device", "cpu"]) == 0
    printed = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert json.loads(report.read_text()) == printed
    return printed


CASES = {
    "jsonl_documents": ["data=jsonl", "data.path={docs}", "train.seq_len=32"],
    "sft_one_example_per_row": ["data=sft", f"data.path={SFT}", "data.sft_pack=false", "train.seq_len=64"],
}


@pytest.mark.parametrize("case", list(CASES))
def test_hf_folder_loss_equals_transformers(
    tmp_path: Path, hf_dir: Path, documents: Path, case: str, capsys: pytest.CaptureFixture[str]
) -> None:
    overrides = [o.replace("{docs}", str(documents)) for o in CASES[case]]
    got = evaluate(hf_dir, overrides, tmp_path / "report.json", capsys)
    theirs, tokens = transformers_loss(hf_dir, overrides)
    print(f"{case}: framework {got['loss']:.7f}, transformers {theirs:.7f}, {tokens} tokens")
    assert got["tokens"] == tokens > 0 and got["windows"] > 1
    assert abs(got["loss"] - theirs) <= TOL
    assert got["perplexity"] == pytest.approx(torch.tensor(got["loss"]).exp().item(), rel=1e-6)
    assert got["model"] == "tiny_llama" and got["checkpoint"] == str(hf_dir)


def test_bad_inputs_are_one_line_exit_2_and_write_no_report(
    tmp_path: Path, hf_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Data shorter than one window (it was silently repeated to fill one), and an HF folder whose
    tokenizer has ids past its model's embedding."""
    short = tmp_path / "short.jsonl"
    short.write_text(json.dumps({"text": "Hello."}) + "\n")
    small = make_hf_folder(tmp_path / "small_vocab", vocab_size=300)  # its tokenizer has 374 tokens
    report = tmp_path / "report.json"
    cases = [
        (hf_dir, ["data=jsonl", f"data.path={short}", "train.seq_len=32"], "is shorter than one window"),
        (small, ["data=jsonl", f"data.path={short}"], "its tokenizer has 374 tokens but its config.json has vocab_size=300"),
        (hf_dir, ["data=synthetic"], "data=synthetic is random tokens"),
    ]  # fmt: skip
    for folder, overrides, message in cases:
        assert main([str(folder), *overrides, "--report", str(report), "--device", "cpu"]) == 2
        err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
        assert len(err) == 1 and message in err[0], err
        assert not report.exists()


def test_report_never_replaces_a_file_evaluate_did_not_write_unless_force(
    tmp_path: Path, hf_dir: Path, documents: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--report RUN/config.yaml`` replaced the run's config, and a folder as --report was an
    IsADirectoryError traceback after scoring: one line, exit 2, the file as it was; an earlier
    report is replaced, and --force replaces any file."""
    data = ["data=jsonl", f"data.path={documents}", "train.seq_len=32", "--device", "cpu"]
    config = tmp_path / "config.yaml"
    config.write_text("train:\n  lr: 0.1\n")
    for report, message in [
        (config, "exists and is not a report evaluate wrote: refusing to overwrite it; valid: a new path"),
        (tmp_path, f"is a folder; valid: a file path (e.g. '{tmp_path / 'evaluate.json'}')"),
    ]:
        assert main([str(hf_dir), *data, "--report", str(report)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith(f"error: --report '{report}' ") and message in err[0], err
        assert config.read_text() == "train:\n  lr: 0.1\n" and sorted(tmp_path.iterdir()) == [config]
    report = tmp_path / "report.json"
    first = evaluate(hf_dir, data, report, capsys)
    assert evaluate(hf_dir, data, report, capsys) == first  # its own earlier report: replaced
    assert evaluate(hf_dir, [*data, "--force"], config, capsys) == first


def test_a_checkpoint_saved_by_two_fsdp_ranks_equals_transformers_on_its_export(
    tmp_path: Path, hf_dir: Path, documents: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Fine-tune the HF folder on 2 gloo ranks (FSDP; forked from this process, tests/dist.py), then
    evaluate the run dir, its checkpoint and its HF export on one data set: the same figure,
    transformers' on the export within 1e-5."""
    from framework.launch.export_run import export_checkpoint
    from tests.dist import train_on_forked_ranks

    run = tmp_path / "run"
    train_on_forked_ranks(
        run, 2, f"model.init_from={hf_dir}", "tokenizer=hf", f"tokenizer.path={hf_dir}",
        "data=synthetic", "mesh=2", "sharding=fsdp", "train.steps=2", "train.seq_len=32",
        "train.global_batch_size=4", "train.eval_every=0", "checkpoint=sync", "freeze=none", "logger.plot=false",
    )  # fmt: skip
    data = ["data=jsonl", f"data.path={documents}", "train.seq_len=32"]
    of_run = evaluate(run, data, tmp_path / "run.json", capsys)
    step = run / "checkpoints" / "step_000002"
    of_step = evaluate(step, data, tmp_path / "step.json", capsys)
    assert of_run["checkpoint"] == of_step["checkpoint"] == str(step)
    assert of_run["model"] == "tiny_llama"  # the run's model, named after its source folder
    export = export_checkpoint(run, tmp_path / "hf")
    of_export = evaluate(export, data, tmp_path / "export.json", capsys)
    theirs, tokens = transformers_loss(export, data)
    print(
        f"2-rank FSDP checkpoint: framework {of_run['loss']:.7f}, transformers {theirs:.7f}, {tokens} tokens"
    )
    assert of_run["tokens"] == of_step["tokens"] == of_export["tokens"] == tokens
    assert abs(of_run["loss"] - theirs) <= TOL and abs(of_export["loss"] - theirs) <= TOL
    assert of_run["loss"] == of_step["loss"]
    base = evaluate(hf_dir, data, tmp_path / "base.json", capsys)
    assert base["loss"] != of_run["loss"]  # it trained


def test_train_eval_sets_are_each_scored_and_logged_on_their_own(
    tmp_path: Path, hf_dir: Path, documents: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """train.eval_sets on 2 FSDP ranks: val_loss/NAME and val_ppl/NAME at every evaluation, one per
    set; the last one equals the loss of the saved model on the same rows (weighted by their trained
    targets, as the validation loss is), computed here. The ranks are forked from this process
    (tests/dist.py: the run's config as train.py composes it, trained as a launched rank trains)."""
    from framework.config.run_values import batch_shape, data_run
    from framework.data.pipeline import eval_set_batches
    from framework.data.tokenizer import load_tokenizer
    from framework.launch.source import load_source
    from framework.record.metrics import read_metrics
    from framework.train.loop import evaluate as loop_evaluate
    from tests.dist import train_on_forked_ranks

    run = tmp_path / "run"
    sets = f"train.eval_sets=[{{name:docs,path:'{documents}'}},{{name:chat,source:sft,path:'{SFT}'}}]"
    train_on_forked_ranks(
        run, 2, f"model.init_from={hf_dir}", "tokenizer=hf", f"tokenizer.path={hf_dir}",
        "data=jsonl", f"data.path={documents}", "mesh=2", "sharding=fsdp", "train.steps=4", "train.seq_len=32",
        "train.global_batch_size=4", "train.micro_batch_size=2", "train.eval_every=2", "train.eval_batches=1",
        "checkpoint=sync", "freeze=none", "logger.plot=false", sets,
    )  # fmt: skip
    rows = [r for r in read_metrics(run) if "val_loss" in r]
    assert [r["step"] for r in rows] == [0, 2, 4]  # before training, then every eval_every
    for r in rows:
        assert {"val_loss/docs", "val_ppl/docs", "val_loss/chat", "val_ppl/chat"} <= set(r)
        assert len({r["val_loss"], r["val_loss/docs"], r["val_loss/chat"]}) == 3
    src = load_source(run, [], torch.device("cpu"))
    tok = load_tokenizer(src.cfg.tokenizer)
    ours = [eval_set_batches(data_run(src.cfg), batch_shape(src.cfg.train), tok, rank, 2) for rank in (0, 1)]  # what each rank scored
    for name in ("docs", "chat"):
        # the ranks' batches scored in one process: the mean over every trained target of both ranks
        both = loop_evaluate(src.model, ours[0][name] + ours[1][name], torch.device("cpu"))
        assert abs(both - rows[-1][f"val_loss/{name}"]) <= TOL, (name, both, rows[-1])


@pytest.mark.parametrize(
    "value, message",
    [
        ("[{name:a,path:'{docs}'},{name:a,path:'{docs}'}]", "train.eval_sets[1].name='a': valid: a unique"),
        ("[{name:'a b',path:'{docs}'}]", "train.eval_sets[0].name='a b'"),
        ("[{name:short,path:'{short}'}]", "train.eval_sets[0].path="),
    ],
    ids=["duplicate", "space", "short"],
)
def test_bad_eval_sets_exit_2_with_one_line_and_no_run_dir(
    tmp_path: Path, documents: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
    value: str, message: str,
) -> None:  # fmt: skip
    from tests.data.test_data_pipeline import train_main

    short = tmp_path / "short.jsonl"
    short.write_text(json.dumps({"text": "Hi."}) + "\n")
    monkeypatch.chdir(ROOT)
    value = value.replace("{docs}", str(documents)).replace("{short}", str(short))
    with pytest.raises(SystemExit) as e:
        train_main(tmp_path / "run", "train.seq_len=32", f"train.eval_sets={value}")
    assert e.value.code == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and message in errors[0], errors
    if "short" in value:
        assert "shorter than one window" in errors[0]
    assert not (tmp_path / "run").exists()


def _rank_report(rank: int, world: int, argv: list[str], report: str) -> None:
    """A rank as ``python -m framework evaluate ... mesh=N`` launches it (``--as-rank``: it makes its
    own process group, places the model as training does, rank 0 writes the report)."""
    assert main([*argv, "--report", report, "--as-rank"]) == 0


@pytest.mark.parametrize(
    "layout",
    [["sharding=fsdp"], ["parallel.pp=2", "parallel.dp_shard=1"]],
    ids=["fsdp", "pp"],
)
def test_two_ranks_give_the_one_rank_figures(
    tmp_path: Path, hf_dir: Path, documents: Path, layout: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    """mesh=2 (2 gloo ranks, forked; FSDP shards or two pipeline stages): the same token and window
    count as one rank, and its loss to float rounding (other sums). 38 windows: the last round of
    micro batches is filled up with masked rows, which count for nothing."""
    from tests.dist import run_ranks

    data = ["data=jsonl", f"data.path={documents}", "train.seq_len=20", "train.global_batch_size=4"]
    one = evaluate(hf_dir, data, tmp_path / "one.json", capsys)
    argv = [str(hf_dir), *data, "mesh=2", *layout, "--device", "cpu"]
    run_ranks(_rank_report, 2, argv, str(tmp_path / "two.json"), init=False)
    two = json.loads((tmp_path / "two.json").read_text())
    print(f"{layout}: 1 rank {one['loss']!r}, 2 ranks {two['loss']!r}, {two['tokens']} tokens")
    assert two["mesh"] == [2] and one["windows"] % 4 != 0  # the last round is filled up
    assert (two["tokens"], two["windows"]) == (one["tokens"], one["windows"])
    assert two["loss"] == pytest.approx(one["loss"], rel=1e-6, abs=0)
    assert two["perplexity"] == pytest.approx(one["perplexity"], rel=1e-5, abs=0)


def test_mesh_2_launches_two_ranks_from_the_command_line(
    tmp_path: Path, hf_dir: Path, documents: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``python -m framework evaluate HF_DIR data=... mesh=2``: two launched ranks (the shipped
    sharding=auto), the one-rank figures; a mesh this host cannot hold is one line, no report."""
    data = ["data=jsonl", f"data.path={documents}", "train.seq_len=32"]
    one = evaluate(hf_dir, data, tmp_path / "one.json", capsys)
    two = evaluate(hf_dir, [*data, "mesh=2"], tmp_path / "two.json", capsys)
    assert two["mesh"] == [2] and (two["tokens"], two["windows"]) == (one["tokens"], one["windows"])
    assert two["loss"] == pytest.approx(one["loss"], rel=1e-6, abs=0)
    report = tmp_path / "too_many.json"
    assert main([str(hf_dir), *data, "mesh=1000", "--report", str(report), "--device", "cpu"]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(err) == 1 and "starts 1000 CPU ranks on this host" in err[0], err
    assert not report.exists()
