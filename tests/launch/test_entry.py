"""The launcher's own refusals (framework.launch.entry): what a refused config leaves behind, and
checkpoint dirs that would share another run's tree. Through the real ``train.py`` and Hydra, in
this process (tests/entry.py)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from framework.config.schema import Config
from framework.launch.prelaunch import JobFailed
from framework.launch.torchrun import from_rank_zero, join_torchrun
from tests.dist import run_ranks
from tests.entry import train_main


def test_refusal_keeps_an_existing_run_dir_and_the_users_files(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = tmp_path / "mine"
    run.mkdir()  # holding only a train.log: it used to look like Hydra's own files and was removed
    (run / "train.log").write_text("my own log\n")
    assert train_main(f"hydra.run.dir={run}", "train.lr=nan") == 2
    assert "train.lr=nan" in capsys.readouterr().err
    assert (run / "train.log").read_text().startswith("my own log\n")
    assert not (run / ".hydra").exists()  # what Hydra added for this invocation is gone


def test_refusal_removes_the_run_dir_it_created(tmp_path: Path) -> None:
    run = tmp_path / "new" / "run"
    assert train_main(f"hydra.run.dir={run}", "train.lr=nan") == 2
    assert not run.exists() and not (tmp_path / "new").exists() and tmp_path.is_dir()


def _other_run(tmp_path: Path) -> Path:
    """Another run's checkpoint root: a committed step dir (manifest.json) and its LOCK."""
    root = tmp_path / "team_b" / "checkpoints"
    (root / "step_000004").mkdir(parents=True)
    (root / "step_000004" / "manifest.json").write_text("{}")
    (root / "LOCK").write_text("{}")
    return root


@pytest.mark.parametrize("inside", ["nested", "step_000004", "step_000004/mine"])
def test_checkpoint_dir_inside_another_runs_checkpoints_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], inside: str
) -> None:
    root = _other_run(tmp_path)
    run = tmp_path / "run"
    code = train_main(f"hydra.run.dir={run}", "checkpoint=sync", f"checkpoint.dir={root / inside}")
    assert code == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "checkpoint.dir=" in errors[0], errors
    assert "delete each other's checkpoints" in errors[0] and str(root) in errors[0], errors
    assert not run.exists() and sorted(p.name for p in root.iterdir()) == ["LOCK", "step_000004"]


def test_run_dir_inside_another_runs_checkpoints_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = _other_run(tmp_path)
    assert train_main(f"hydra.run.dir={root / 'step_000004' / 'run'}", "checkpoint=sync") == 2
    assert "hydra.run.dir=" in capsys.readouterr().err
    assert sorted(p.name for p in (root / "step_000004").iterdir()) == ["manifest.json"]


def test_a_folder_next_to_another_runs_checkpoints_is_fine(tmp_path: Path) -> None:
    from framework.checkpoint.store import enclosing_checkpoint

    root = _other_run(tmp_path)
    assert enclosing_checkpoint(tmp_path / "team_b" / "mine") is None
    assert enclosing_checkpoint(root) is None  # the root itself: resuming it is the lock's business
    assert enclosing_checkpoint(root / "x" / "y")[0] == root.resolve()


@pytest.mark.parametrize("what", ["a file", "a folder export-hf did not write"])
def test_export_hf_onto_a_users_hf_in_a_reused_run_dir_is_refused_before_training(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], what: str
) -> None:
    """checkpoint.export_hf writes RUN_DIR/hf after training: a file there was a FileExistsError
    traceback once the run had trained; a user's folder there would have lost its files."""
    run = tmp_path / "run"
    run.mkdir()
    if what == "a file":
        (run / "hf").write_text("mine")
    else:
        (run / "hf").mkdir()
        (run / "hf" / "config.json").write_text("mine")
    assert train_main(f"hydra.run.dir={run}", "checkpoint=sync", "checkpoint.export_hf=true") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert err[0].startswith(f"error: checkpoint.export_hf=true writes {run / 'hf'}, ") and what in err[0], (
        err
    )
    assert "valid: move it away, or checkpoint.export_hf=false" in err[0]
    mine = run / "hf" if what == "a file" else run / "hf" / "config.json"
    assert (
        mine.read_text() == "mine"
        and not (run / "checkpoints").exists()
        and not (run / "metrics.jsonl").exists()
    )


def _join_as_torchrun_rank(rank: int, world: int, run_dir: str, rank1_lr: float | None) -> tuple:
    """One torchrun rank (the launcher's variables set, no group yet): join, then hear rank 0."""
    dcfg = OmegaConf.structured(Config())
    if rank == 1 and rank1_lr is not None:
        dcfg.train.lr = rank1_lr
    try:
        join_torchrun(dcfg, Path(run_dir))
    except JobFailed as e:
        return ("join", str(e), e.code)
    value, shared = from_rank_zero(rank, True, lambda: {"plan": "rank 0's own"}, lambda v: "sha-of-rank-0")
    assert (value is not None) == (rank == 0)  # the others get the hash only, never rank 0's objects

    def refuse() -> None:
        raise JobFailed("model.dim=7 is not divisible by model.n_heads=2", 2)

    try:
        from_rank_zero(rank, True, refuse)
    except JobFailed as e:
        return ("rank 0", shared, str(e), e.code)
    return ("nothing refused",)


def test_torchrun_ranks_hear_rank_zeros_refusal_and_refuse_another_composition(tmp_path: Path) -> None:
    """Real gloo ranks joining as torchrun's do: rank 0's refusal is every rank's one line and exit
    status; a rank that composed another config is refused before rank 0 resolves anything."""
    same = run_ranks(_join_as_torchrun_rank, 2, str(tmp_path), None, init=False)
    line = "model.dim=7 is not divisible by model.n_heads=2"
    assert same == [("rank 0", "sha-of-rank-0", line, 2)] * 2, same
    other = run_ranks(_join_as_torchrun_rank, 2, str(tmp_path), 0.5, init=False)
    for kind, message, code in other:
        assert kind == "join" and code == 2 and "\n" not in message, other
        assert message == "ranks [1] composed a different config than rank 0; differing keys: ['train.lr']"


def _held_by_a_live_run(root: Path, run_dir: Path) -> subprocess.Popen:
    """``root/LOCK`` naming a live process of this host (a real one, not this test's own pid, which
    the lock would take for ours): the state of a run dir whose run is training."""
    import json
    import socket

    owner = subprocess.Popen(["sleep", "120"])
    root.mkdir(parents=True, exist_ok=True)
    record = {"user": "them", "host": socket.gethostname(), "pid": owner.pid, "launcher_pid": None}
    (root / "LOCK").write_text(json.dumps({**record, "run_id": str(run_dir), "since": "now"}))
    return owner


@pytest.mark.parametrize("checkpoint", ["checkpoint=sync", "checkpoint=none"])
def test_a_run_dir_a_live_run_holds_is_refused_before_hydra_writes_into_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], checkpoint: str
) -> None:
    """A second launch into a live run's dir was refused by the lock only after Hydra had rewritten
    that run's .hydra/ files and written into its train.log."""
    run = tmp_path / "run"
    (run / ".hydra").mkdir(parents=True)
    records = {run / ".hydra" / "config.yaml": "theirs\n", run / "train.log": "their log\n"}
    for path, text in records.items():
        path.write_text(text)
    owner = _held_by_a_live_run(run / "checkpoints", run)
    try:
        assert train_main(f"hydra.run.dir={run}", checkpoint, "train.steps=1") == 2
    finally:
        owner.kill()
        owner.wait()
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: hydra.run.dir={str(run)!r} belongs to a live run"), (
        err
    )
    assert f"pid {owner.pid}" in err[0] and "valid: another hydra.run.dir" in err[0], err
    assert {path: path.read_text() for path in records} == records
    assert sorted(p.name for p in (run / ".hydra").iterdir()) == ["config.yaml"]


def test_a_checkpoint_dir_a_live_run_holds_is_refused_before_hydra_writes_the_run_dir(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run, root = tmp_path / "run", tmp_path / "shared_checkpoints"
    run.mkdir()
    (run / "train.log").write_text("their log\n")
    owner = _held_by_a_live_run(root, tmp_path / "their_run")
    try:
        assert (
            train_main(f"hydra.run.dir={run}", "checkpoint=sync", f"checkpoint.dir={root}", "train.steps=1")
            == 2
        )
    finally:
        owner.kill()
        owner.wait()
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: checkpoint.dir={str(root)!r} is in use by run"), err
    assert sorted(p.name for p in run.iterdir()) == ["train.log"]
    assert (run / "train.log").read_text() == "their log\n"


def test_a_second_launch_while_the_first_starts_is_one_line_and_the_first_keeps_its_files(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Two launches of one run dir seconds apart: the first's rank takes the checkpoint lock only once
    its model is built, so the second passed every check, rewrote the first's config.yaml and failed
    inside its rank with a LockHeld traceback. The launcher now holds the lock from before it writes
    the run files (its rank takes it over), so the second is refused in one line."""
    import time

    from framework.checkpoint import lock
    from tests.entry import start_forked

    run = tmp_path / "run"
    first = start_forked(
        f"hydra.run.dir={run}", "train.steps=200", "checkpoint=sync", log=tmp_path / "first.log"
    )
    try:
        deadline = time.monotonic() + 120
        while not (run / "config.yaml").is_file() and time.monotonic() < deadline and first.poll() is None:
            time.sleep(0.05)
        assert (run / "config.yaml").is_file(), (tmp_path / "first.log").read_text()[-3000:]
        owner = lock.read(run / "checkpoints")
        assert owner is not None and owner.pid == first.pid  # the launcher's, before any rank built
        written = (run / "config.yaml").read_text()
        assert train_main(f"hydra.run.dir={run}", "train.steps=3", "checkpoint=sync") == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith(
            f"error: hydra.run.dir={str(run)!r} belongs to a live run"
        ), err
        assert (run / "config.yaml").read_text() == written
    finally:
        first.kill()
        first.wait(60)


def test_ranks_that_failed_for_good_say_how_to_go_on(tmp_path: Path) -> None:
    """The line after the last restart said which rank died but not what now: no restart is left,
    and the newest checkpoint, if any, is where a run of the same run dir resumes."""
    from framework.launch.outcome import after_failure

    cfg, root = Config(), tmp_path / "checkpoints"
    assert (
        after_failure(cfg, tmp_path, None)
        == "no restart left (run.max_restarts=0), and no checkpoint was saved"
    )
    step = root / "step_000004"
    step.mkdir(parents=True)
    (step / "manifest.json").write_text('{"step": 4}')
    assert after_failure(cfg, tmp_path, root) == (
        f"no restart left (run.max_restarts=0); run again with hydra.run.dir={tmp_path} to resume from {step}"
    )

def test_an_option_of_an_extra_not_installed_is_one_line_naming_the_extra() -> None:
    """The base install leaves wandb out (pyproject's ``wandb`` extra): ``logger=wandb`` without the
    package is refused before launch, naming the extra. Checked with a package name that is not
    installed anywhere (wandb itself is, in the dev extra)."""
    from framework.config.schema import LoggerKind
    from framework.launch.prelaunch import EXTRAS, check_extras

    assert [(o, p, e) for o, _, p, e in EXTRAS] == [("logger=wandb", "wandb", "wandb")]
    cfg = Config()
    cfg.logger.kind = LoggerKind.wandb
    check_extras(cfg)  # installed here: no refusal
    missing = [("logger=wandb", lambda c: c.logger.kind is LoggerKind.wandb, "framework_no_such_pkg", "wandb")]
    with pytest.raises(ValueError) as e:
        check_extras(cfg, missing)
    assert str(e.value) == (
        "logger=wandb needs the framework_no_such_pkg package, which the base install leaves out: "
        "pip install -e '.[wandb]' (the dev extra has it too)"
    )
    cfg.logger.kind = LoggerKind.console
    check_extras(cfg, missing)  # not used: no refusal
