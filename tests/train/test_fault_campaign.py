"""A short fault campaign (benchmarks/fault_campaign.py): one seeded round of faults on the one-process
layout, each injected into a real ``train.py`` run, recovered and compared bit for bit with an unbroken
run. The long schedule over every layout (FSDP, pp x dp, async saves, LoRA, MoE ep=2) is the
benchmark's (its figure: benchmarks/PERF.md, "Fault campaign")."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from benchmarks import fault_campaign as fc

KINDS = ["kill_rank", "sigterm", "kill_in_save", "corrupt", "two_resumes"]


def test_a_seeded_round_of_faults_all_survive_bitwise(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Five faults, one of each kind below (a SIGKILLed process, a preemption, a kill while a save
    is written, a bit flipped or a file truncated in the newest checkpoint, two relaunches racing
    for the lock), each at a seeded random time: every final checkpoint and last loss is bitwise the
    unbroken run's."""
    args = ["--seed", "40", "--faults", str(len(KINDS)), "--layouts", "one", "--kinds", ",".join(KINDS)]
    code = fc.main([*args, "--work", str(tmp_path)])
    out = capsys.readouterr().out
    assert code == 0, out
    lines = [ln for ln in out.splitlines() if ln.startswith("#")]
    assert sorted(re.match(r"#\d+ (\w+) on one: ", ln).group(1) for ln in lines) == sorted(KINDS), out
    assert all(": survived bitwise [" in ln for ln in lines), out
    assert re.search(rf"^{len(KINDS)}/{len(KINDS)} faults survived bitwise \(\d+s\)$", out, re.M), out


def test_the_schedule_follows_the_seed_and_bad_arguments_are_one_line(
    capsys: pytest.CaptureFixture[str],
) -> None:
    a = fc.schedule(3, 12, list(fc.LAYOUTS), list(fc.KINDS))
    b = fc.schedule(3, 12, list(fc.LAYOUTS), list(fc.KINDS))
    assert [(f.layout, f.kind, f.rng.random()) for f in a] == [(f.layout, f.kind, f.rng.random()) for f in b]
    kinds = [f.kind for f in fc.schedule(3, 2 * len(fc.KINDS), list(fc.LAYOUTS), list(fc.KINDS))]
    if fc.unshare_works():  # each kind once per round
        assert sorted(kinds[: len(fc.KINDS)]) == sorted(fc.KINDS) == sorted(kinds[len(fc.KINDS) :])
    for bad, named in ((["--kinds", "meteor"], "'meteor'"), (["--faults", "0"], "--faults=0")):
        assert fc.main(bad) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith(f"error: {named} is not valid; valid: "), err
