"""The callback seam (framework.train.callbacks): a new callback is one module plus one YAML.

The end-to-end test writes both outside the repository (a module in a tmp dir, allowed through
``run.instantiate_allow`` on the command line; a YAML in a config dir on Hydra's search path), runs
real 2-rank training through ``train.py`` and reads back which hooks fired, in which order, with
which step numbers, on both ranks, then resumes the run from its checkpoint. The refusals are one
line, exit 2, before launch.
"""

from __future__ import annotations

import json
import os
import textwrap
from pathlib import Path

import pytest
import torch

from framework.config.schema import SHIPPED_CALLBACKS, Config, RunConfig, default_callbacks
from framework.planner.resolve import resolve
from framework.record.metrics import read_metrics
from framework.train.callbacks import Callback, Callbacks, build_callbacks, check_callbacks
from framework.verify.baseline import PerfFigures, baseline_key, device_name, save_baseline
from tests.config.test_config import compose_config
from tests.entry import ROOT, train_main
from tests.train.test_train import train
from tests.train.test_train_golden import reference_lr

MODULE = "team_cb_recorder"  # a name no other test imports (the forked launcher imports it)
RECORDER = '''
"""A team's own callback: it writes every hook it hears to the run dir, one JSON line each."""

import json

from framework.train.callbacks import Callback


class Recorder(Callback):
    def __init__(self, tag: str = "unset") -> None:
        self.tag = tag
        self.run = None

    def _log(self, run, hook, step=None, **more):
        row = {"hook": hook, "step": step, "tag": self.tag, "state_step": run.state.step, **more}
        with (run.run_dir / f"hooks_rank{run.rank}.jsonl").open("a") as f:
            f.write(json.dumps(row) + "\\n")

    def setup(self, run):
        self.run = run
        self._log(run, "setup", built=run.runner is not None)

    def on_resume(self, run, step, extra):
        self._log(run, "resume", step, extra_step=extra.get("step"), built=run.runner is not None)

    def after_step(self, run, step):
        self._log(run, "after_step", step)

    def on_step_read(self, run, step):
        self._log(run, "step_read", step, read=run.last.step)

    def on_rebuild(self, run, step):
        self._log(run, "rebuild", step)

    def on_save(self, run, step):
        self._log(run, "save", step)

    def on_finish(self, run, summary):
        self._log(run, "finish", summary.steps)

    def close(self):
        if self.run is not None:
            self._log(self.run, "close")
'''


LR_MODULE = "team_cb_lr"
LR_RECORDER = '''
"""A team's learning-rate callback: the rates each hook sees, one JSON line each; ``halve_at``: halve
every group's rate before that step, as a callback that adjusts the schedule would."""

import json

from framework.train.callbacks import Callback


class LrRecorder(Callback):
    def __init__(self, halve_at: int = -1) -> None:
        self.halve_at = halve_at

    def _log(self, run, hook, step, lrs):
        row = {"hook": hook, "step": step, "lrs": list(lrs)}
        with (run.run_dir / f"lrs_rank{run.rank}.jsonl").open("a") as f:
            f.write(json.dumps(row) + "\\n")

    def before_step(self, run, step):
        if step == self.halve_at:
            for group in run.runner.optimizer.param_groups:
                group["lr"] /= 2
        self._log(run, "before", step, [g["lr"] for g in run.runner.optimizer.param_groups])
        self._log(run, "before_scheduler", step, run.runner.scheduler.get_last_lr())

    def after_step(self, run, step):
        self._log(run, "after_scheduler", step, run.runner.scheduler.get_last_lr())

    def on_step_read(self, run, step):
        self._log(run, "read", step, run.last.result.lrs)
'''


def _install(tmp: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, list[str]]:
    """The team's two files, and the command line that uses them (and its learning-rate callback,
    ``callbacks=[default,lr]``)."""
    code, conf = tmp / "code", tmp / "conf" / "callbacks"
    code.mkdir(parents=True)
    conf.mkdir(parents=True)
    (code / f"{MODULE}.py").write_text(RECORDER)
    (code / f"{LR_MODULE}.py").write_text(LR_RECORDER)
    (conf / "lr.yaml").write_text(f"lr:\n  _target_: {LR_MODULE}.LrRecorder\n  halve_at: -1\n")
    (conf / "recorder.yaml").write_text(
        textwrap.dedent(f"""\
            # A team's callback: every hook to hooks_rank<R>.jsonl.
            recorder:
              _target_: {MODULE}.Recorder
              tag: from-yaml
            """)
    )
    monkeypatch.syspath_prepend(str(code))  # the launcher, forked from this process, validates it
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(code), str(ROOT)]))  # the spawned ranks
    allow = ",".join([*RunConfig().instantiate_allow, f"{MODULE}.", f"{LR_MODULE}."])
    return tmp / "conf", [
        f"hydra.searchpath=[file://{tmp / 'conf'}]",
        "callbacks=[default,recorder]",
        f"run.instantiate_allow=[{allow}]",
    ]


def _hooks(run: Path, rank: int) -> list[dict]:
    return [json.loads(line) for line in (run / f"hooks_rank{rank}.jsonl").read_text().splitlines()]


def _check_launch(events: list[dict], first: int, last: int, saves: list[int]) -> None:
    """One launch's hooks: setup, resume at ``first``, each step queued then read once, in order,
    saves after their step was read, finish, close."""
    names = [e["hook"] for e in events]
    assert names[:2] == ["setup", "resume"] and names[-2:] == ["finish", "close"], names
    assert events[0]["built"] is False and events[1]["built"] is True  # setup comes before the model
    assert events[1]["step"] == first and events[-2]["step"] == last
    assert (events[1]["extra_step"] == first) if first else events[1]["extra_step"] is None
    steps = list(range(first + 1, last + 1))
    queued = [e["step"] for e in events if e["hook"] == "after_step"]
    read = [e["step"] for e in events if e["hook"] == "step_read"]
    assert queued == steps and read == steps, (queued, read)
    assert all(e["read"] == e["step"] for e in events if e["hook"] == "step_read")
    at = {(e["hook"], e["step"]): i for i, e in enumerate(events)}
    for k in steps:
        assert at[("after_step", k)] < at[("step_read", k)]
        assert events[at[("after_step", k)]]["state_step"] == k  # the loop's counter agrees
    assert [e["step"] for e in events if e["hook"] == "save"] == saves
    assert all(at[("step_read", k)] < at[("save", k)] for k in saves)
    assert not [e for e in events if e["hook"] == "rebuild"]
    assert {e["tag"] for e in events} == {"from-command-line"}


def test_a_new_callback_is_one_module_and_one_yaml(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _, args = _install(tmp_path, monkeypatch)
    run = tmp_path / "run"
    common = [*args, "callbacks.recorder.tag=from-command-line", "mesh=2", "train.seq_len=32"]
    common += ["train.eval_every=0", "train.log_every=2", "logger.plot=false", "freeze=none"]
    common += ["checkpoint=sync", "checkpoint.every_steps=3"]
    # Steps 1-6: step 5 is read one step late (the lag), after step 6 was queued.
    proc = train(run, *common, "train.steps=6")
    assert proc.returncode == 0, proc.stderr[-3000:]
    for rank in (0, 1):
        events = _hooks(run, rank)
        _check_launch(events, 0, 6, [3, 6])
        names = [(e["hook"], e["step"]) for e in events]
        lag = names.index(("after_step", 6))
        assert names[lag - 1 : lag + 2] == [("after_step", 5), ("after_step", 6), ("step_read", 5)]
    (run / "hooks_rank0.jsonl").unlink()
    (run / "hooks_rank1.jsonl").unlink()
    # The same run dir again, two steps longer: it resumes from step 6's checkpoint.
    proc = train(run, *common, "train.steps=8")
    assert proc.returncode == 0, proc.stderr[-3000:]
    for rank in (0, 1):
        _check_launch(_hooks(run, rank), 6, 8, [8])


@pytest.mark.parametrize("mesh", ["1", "2"])
def test_a_learning_rate_callback_sees_the_rate_each_step_ran_with(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mesh: str
) -> None:
    """Under warmup then cosine, step k's rate (an independent formula, the golden test's) is what
    ``before_step(k)`` reads from the optimizer and the scheduler, and what ``on_step_read(k)`` reads
    in ``run.last.result.lrs``, for every param group, on every rank, with the lag on (step 2 is read
    after step 3 was queued); ``after_step(k)`` already sees step k + 1's. A rate a callback sets in
    ``before_step`` is the one the step runs with (and logs); the schedule resumes after it."""
    _, (search, _recorder, allow) = _install(tmp_path, monkeypatch)
    run, steps, warmup, lr, floor = tmp_path / "run", 6, 4, 1e-3, 0.1
    proc = train(
        run, search, allow, "callbacks=[default,lr]", "callbacks.lr.halve_at=5", f"mesh={mesh}",
        f"train.steps={steps}", f"train.warmup_steps={warmup}", f"train.lr={lr}", f"train.min_lr_ratio={floor}",
        "lr_scheduler=cosine", "train.seq_len=32", "train.eval_every=0", "train.log_every=3",
        "logger.plot=false", "freeze=none", "checkpoint=none",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    expected = {k: reference_lr(k - 1, lr, warmup, steps, floor) for k in range(1, steps + 2)}
    ran = dict(expected) | {5: expected[5] / 2}  # the callback halved step 5's
    for rank in range(int(mesh)):
        rows = [json.loads(line) for line in (run / f"lrs_rank{rank}.jsonl").read_text().splitlines()]
        seen: dict[str, dict[int, list[float]]] = {}
        for r in rows:
            seen.setdefault(r["hook"], {})[r["step"]] = r["lrs"]
        assert all(len(v) == 2 for v in seen["read"].values())  # AdamW's two groups: decay, no decay
        for k in range(1, steps + 1):
            assert seen["before"][k] == pytest.approx([ran[k]] * 2, rel=1e-12), k
            assert seen["read"][k] == pytest.approx([ran[k]] * 2, rel=1e-12), k
            assert seen["before_scheduler"][k] == pytest.approx([expected[k]] * 2, rel=1e-12), k
            assert seen["after_scheduler"][k] == pytest.approx([expected[k + 1]] * 2, rel=1e-12), k
        order = [(r["hook"], r["step"]) for r in rows if r["hook"] in ("after_scheduler", "read")]
        assert order.index(("read", 2)) > order.index(("after_scheduler", 3))  # read one step late
    logged = {r["step"]: r["lr"] for r in read_metrics(run) if "lr" in r}
    assert logged == pytest.approx({3: ran[3], 6: ran[6]}, rel=1e-12)


def test_a_rebuild_is_heard_and_the_fault_callback_rearms_on_the_new_model(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The circuit breaker swaps compile -> eager at step 5 (a baseline p99 no step meets); every
    callback hears on_rebuild before step 5's read, and the shipped fault injection hooks the new
    model: the forward of step 7 raises there, and every callback is still closed."""
    _, args = _install(tmp_path, monkeypatch)
    over = ["verify=on", "executor=compile", "executor.backend=eager", "train.seq_len=32"]
    resolved = resolve(compose_config(*over))
    c, cpu = resolved.cfg, device_name(torch.device("cpu"))
    key = baseline_key(c.model.name, c.mesh.shape, resolved.plan.layout, 1, cpu, c.executor.mode)
    store = tmp_path / "baselines.json"
    save_baseline(store, key, PerfFigures(1e-9, 1e-9, 1e9, None, None), {})
    run = tmp_path / "run"
    proc = train(
        run, *args, *over, f"verify.baseline={store}", "verify.breaker_window=2", "verify.breaker_patience=1",
        "train.steps=10", "train.eval_every=0", "logger.plot=false", "freeze=none",
        "run.fault_raise_at_step=7",
    )  # fmt: skip
    assert (
        proc.returncode != 0
        and "run.fault_raise_at_step=7: injected fault on rank 0" in proc.stdout + proc.stderr
    )
    names = [(e["hook"], e["step"]) for e in _hooks(run, 0)]
    assert names[names.index(("after_step", 5)) :] == [
        ("after_step", 5), ("rebuild", 5), ("step_read", 5), ("after_step", 6), ("step_read", 6), ("close", None),
    ]  # fmt: skip
    fallback = [r for r in read_metrics(run) if r.get("event") == "fallback/circuit_breaker"]
    assert [r["step"] for r in fallback] == [5] and "executor eager" in fallback[0]["detail"]


def test_logger_wandb_still_selects_the_wandb_callback_and_a_resume_continues_its_run(tmp_path: Path) -> None:
    """``logger=wandb`` (offline here) as before: the run id goes into each checkpoint, and a resume
    continues that wandb run from the checkpoint alone (the run dir's id file is removed first)."""
    run = tmp_path / "run"
    common = ["logger=wandb", "logger.mode=offline", "checkpoint=sync", "train.seq_len=32"]
    common += ["train.eval_every=0", "train.log_every=2", "logger.plot=false", "freeze=none"]
    proc = train(run, *common, "train.steps=4")
    assert proc.returncode == 0, proc.stderr[-3000:]
    run_id = (run / "wandb_run_id").read_text().strip()
    extras = [json.loads(p.read_text()) for p in (run / "checkpoints").rglob("extra.json")]
    assert extras and {e["extra"]["wandb_run_id"] for e in extras} == {run_id}
    (run / "wandb_run_id").unlink()
    proc = train(run, *common, "train.steps=6")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (run / "wandb_run_id").read_text().strip() == run_id
    assert len(list((run / "wandb").glob(f"offline-run-*-{run_id}"))) == 2  # one per launch, one run id


@pytest.mark.parametrize(
    "extra, message",
    [
        (["callbacks=[default,nosuch]"], "no such option in group 'callbacks'; available: "),
        (["+callbacks.loose.tag=x"], "callbacks.loose={'tag': 'x'} is not a callback (no _target_)"),
        (["callbacks.recorder.tga=x"], "no key 'tga' in callbacks.recorder; valid keys: _target_, tag"),
        (["+callbacks.recorder.tga=x"], f"unexpected keyword argument 'tga'; {MODULE}.Recorder takes: tag"),
        (["callbacks.recorder._target_=os.system"], "callbacks.recorder._target_='os.system' is not on"),
        (["run.profile=true", "callbacks.profiler=null"], "run.profile=true is set, but the profiler"),
        # Round 4: a callback's node is values, never instructions or objects for Hydra to build.
        (["+callbacks.recorder._args_=[x]"], "callbacks.recorder._args_ is refused: a callback takes keyword"),
        (["+callbacks.recorder._partial_=true"], "callbacks.recorder._partial_ is refused"),
        (
            ["callbacks.recorder.tag={_target_: torch.optim.SGD}"],
            "callbacks.recorder.tag._target_='torch.optim.SGD' is refused: a callback's values are plain data",
        ),
        (["callbacks.recorder._target_=torch.optim.SGD"], "='torch.optim.SGD' is not a callback class"),
    ],
)
def test_bad_callbacks_are_one_line_before_launch(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    extra: list,
    message: str,
) -> None:
    _, args = _install(tmp_path, monkeypatch)
    run = tmp_path / "run"
    assert train_main(f"hydra.run.dir={run}", *args, *extra) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err, err
    assert not run.exists()


def test_a_target_off_the_allowlist_is_refused_even_when_installed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The YAML alone is not enough: the module must be allowed on the command line (or in conf/)."""
    _, args = _install(tmp_path, monkeypatch)
    run = tmp_path / "run"
    assert train_main(f"hydra.run.dir={run}", *args[:2]) == 2
    err = capsys.readouterr().err
    assert f"callbacks.recorder._target_='{MODULE}.Recorder' is not on the instantiation allowlist" in err


def test_the_shipped_callbacks_are_the_default_option_and_build() -> None:
    """conf/callbacks/default.yaml lists the schema's default mapping, in its order; each builds."""
    composed = compose_config()
    assert composed.callbacks == default_callbacks() == Config().callbacks
    built = build_callbacks(composed.callbacks, RunConfig().instantiate_allow)
    assert built.names == list(SHIPPED_CALLBACKS)
    assert all(isinstance(cb, Callback) for _, cb in built.named)
    off = compose_config("callbacks.wandb=null")
    assert build_callbacks(off.callbacks, RunConfig().instantiate_allow).names == [
        n for n in SHIPPED_CALLBACKS if n != "wandb"
    ]
    check_callbacks(Config())


def test_every_callback_is_closed_and_the_first_error_raised() -> None:
    closed: list[str] = []

    class Closes(Callback):
        def __init__(self, name: str, fail: bool) -> None:
            self.name, self.fail = name, fail

        def close(self) -> None:
            closed.append(self.name)
            if self.fail:
                raise RuntimeError(self.name)

    cbs = Callbacks([(n, Closes(n, fail=n in "bc")) for n in "abcd"])
    with pytest.raises(RuntimeError, match="c"):
        with cbs:
            pass
    assert closed == ["d", "c", "b", "a"]
