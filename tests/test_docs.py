"""Generated docs are fresh, and the Hydra surface (--help, --cfg job) shows what it should."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from framework.config.schema import GROUPS
from framework.launch import code_refs, docs
from tests.entry import train_forked
from tests.test_structure import LAYERS


def test_config_reference_help_and_output_blocks_are_not_stale() -> None:
    """docs/config.md, the --help text and every generated dry-run block of the pages: each is what
    the code (the planner's cost model included) renders now."""
    assert docs.stale() == [], "run `python -m framework docs` and commit the result"
    assert docs.BEGIN in docs.REFERENCE.read_text()


def test_a_planned_number_edited_or_moved_makes_its_block_stale(tmp_path: Path) -> None:
    """The overview's plans were hand-copied and went stale when the planner moved (the 7B's
    layout and GiB, the 70B's step time): a block that differs from its command's output is found,
    and regenerating it makes it fresh. Only dry runs are generated."""
    from framework.launch import doc_outputs

    found = doc_outputs.blocks()
    pages = {b.page.name for b in found}
    assert {"overview.md", "layouts.md"} <= pages and len(found) >= 3
    assert all(b.command.endswith("run.dry_run=true") for b in found)
    page = tmp_path / "overview.md"
    text = docs.ROOT.joinpath("docs", "overview.md").read_text()
    block = next(b for b in found if b.page.name == "overview.md" and "llama7b" in b.command)
    edited = block.body.replace("GiB of 80 GiB", "GiB of 81 GiB")
    assert edited != block.body
    page.write_text(text.replace(block.body, edited))
    assert doc_outputs.stale_pages([page]) == [page]
    assert doc_outputs.write_pages([page]) == [page]
    assert doc_outputs.stale_pages([page]) == [] and page.read_text() == text
    with pytest.raises(ValueError, match="only `python train.py ... run.dry_run=true` is generated"):
        doc_outputs.train_args("python train.py mesh=2")


def test_stale_reference_is_detected(tmp_path, monkeypatch) -> None:
    """An edit by hand inside the markers of docs/config.md is caught (the check can fail)."""
    page = tmp_path / "config.md"
    page.write_text(docs.REFERENCE.read_text().replace("`train.steps`", "`train.stepz`"))
    monkeypatch.setattr(docs, "REFERENCE", page)
    assert docs.stale(outputs=False) == [page]
    page.write_text(docs.replace_section(page.read_text(), docs.render_reference()))
    assert docs.stale(outputs=False) == []


def test_readme_opens_with_the_two_commands_and_links_pages_that_exist() -> None:
    """CI and users copy the first block; the README's links all land on a docs/ page."""
    readme = (docs.ROOT / "README.md").read_text()
    first = readme.split("```bash\n", 1)[1].split("```", 1)[0].splitlines()
    assert first[0].startswith('pip install -e ".[dev]" && python train.py ')
    assert first[1].startswith("pytest ")
    assert "CPU build of torch" in readme
    links = re.findall(r"\]\((docs/[\w.]+\.md)\)", readme)
    assert len(set(links)) >= 10
    assert [link for link in links if not (docs.ROOT / link).is_file()] == []
    assert "config-reference:begin" not in readme  # the reference lives in docs/config.md


def test_reference_covers_every_field_and_group() -> None:
    text = docs.render_reference()
    for key in ("train.steps", "mesh.hardware.peak_tflops", "run.instantiate_allow", "logger.mode"):
        assert f"`{key}`" in text
    assert set(GROUPS) <= set(docs.GROUP_DESCRIPTIONS)


def test_help_opens_with_commands_and_the_dump_is_one_flag_away() -> None:
    """``python train.py --help``: usage and the common commands first, groups with their options,
    no config dump; ``--help --all``: the composed config too (with overrides applied); ``--cfg job``
    prints the config. Forked from this process (tests/entry.py)."""
    out = train_forked("--help", timeout=120)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].startswith("train.py: ") and lines[5] == "== Common commands =="
    assert [ln.split()[:2] for ln in lines[6 : 6 + len(docs.EXAMPLES)]] == [
        c.split()[:2] for c, _ in docs.EXAMPLES
    ]
    assert "sharding       parallel layout" in out.stdout
    assert "logger: console, wandb" in out.stdout and "recipe: " in out.stdout
    assert "== Composed config" not in out.stdout and "--help --all" in out.stdout
    assert len(lines) < 80  # it was 250 with the dump
    full = train_forked("--help", "--all", "train.steps=7", timeout=120)
    assert full.returncode == 0, full.stderr
    assert "== Composed config" in full.stdout and "  steps: 7\n" in full.stdout
    assert "== Common commands ==" not in full.stdout
    cfg = train_forked("--cfg", "job", "logger=wandb", timeout=120)
    assert cfg.returncode == 0 and "kind: wandb" in cfg.stdout


def test_full_help_flag_only_with_help() -> None:
    assert docs.full_help_flag(["train.py", "--help", "--all"]) == ["train.py", "--help", docs.FULL_HELP]
    assert docs.full_help_flag(["train.py", "--all"]) == ["train.py", "--all"]  # Hydra then refuses it


def readme_dry_runs() -> list[str]:
    """Every ``python train.py ... run.dry_run=true`` line of README.md's (and docs/*.md's) bash blocks."""
    import re
    import shlex

    from tests.entry import ROOT

    texts = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    lines = []
    for path in texts:
        for block in re.findall(r"```bash\n(.*?)```", path.read_text(), re.S):
            for line in block.splitlines():
                cmd = line.split("  #")[0].strip()
                if cmd.startswith("python train.py ") and "run.dry_run=true" in cmd and " -m " not in cmd:
                    lines.append(" ".join(shlex.split(cmd)[2:]))
    return lines


@pytest.mark.parametrize("args", readme_dry_runs())
def test_each_readme_dry_run_exits_0_and_fits_its_devices(tmp_path: Path, args: str) -> None:
    import json

    from tests.entry import train_main

    run = tmp_path / "run"
    assert train_main(f"hydra.run.dir={run}", *args.split()) == 0, args
    memory = json.loads((run / "plan.json").read_text())["memory"]
    assert memory["total"] <= memory["device"], (args, memory)


# The commands that train, as a new user copies them: README.md's and docs/overview.md's (the page
# the README sends them to first), from their bash blocks. Each line is either run here (on CPU,
# shortened by SHORT) or listed in NOT_ON_CPU with why; a new line in neither fails the test.
FIRST_PAGES = ("README.md", "docs/overview.md")
NOT_ON_CPU = {  # the line -> why not here, and the device its dry run plans for
    "recipe=llama1b sharding=fsdp mesh=8 nccl=gdr3 train.global_batch_size=64": (
        "a 1B model on 8 GPUs",
        "mesh/hardware=h100_sxm",
    ),
    "mesh=2x4 sharding=hsdp": ("8 ranks on a 2-core CI machine", "mesh/hardware=cpu"),
    "mesh=2x4 parallel.dp_replicate=2 parallel.dp_shard=2 parallel.tp=2": (
        "8 ranks on a 2-core CI machine",
        "mesh/hardware=cpu",
    ),
}
# A few steps, one validation and the final checkpoint: what the full run does, at a test's cost.
SHORT = [
    "train.steps=3",
    "train.warmup_steps=1",
    "train.log_every=1",
    "train.eval_every=3",
    "train.eval_batches=1",
]
SHORT += ["logger.plot=false", "executor.warmup_steps=1"]  # steps 2 and 3 timed: the log shows tok/s


def training_commands() -> list[str]:
    """The ``python train.py ...`` lines of FIRST_PAGES' bash blocks that train (not a dry run, not
    --help / --cfg), as their arguments; ``pip install ... && python train.py`` counts as its second half."""
    import shlex

    from tests.entry import ROOT

    out = []
    for page in FIRST_PAGES:
        for block in re.findall(r"```bash\n(.*?)```", (ROOT / page).read_text(), re.S):
            for line in block.splitlines():
                cmd = line.split("  #")[0].strip().split("&& ")[-1]
                if not cmd.startswith("python train.py") or "run.dry_run=true" in cmd or "--" in cmd:
                    continue
                out.append(" ".join(shlex.split(cmd)[2:]))
    return out


def test_the_first_pages_list_commands_that_train() -> None:
    """The extraction finds the README's first command and the overview's; each is run or excused."""
    found = training_commands()
    assert "" in found and "mesh=4" in found, found  # `python train.py` itself and 4 local ranks
    assert set(NOT_ON_CPU) <= set(found), set(NOT_ON_CPU) - set(found)  # no stale excuse


@pytest.mark.parametrize("args", [a for a in training_commands() if a not in NOT_ON_CPU])
def test_each_first_page_command_that_trains_exits_0(tmp_path: Path, args: str) -> None:
    """Run as written, shortened; any non-zero exit fails (the README's first command exited 0 but
    others went red unnoticed: only dry runs were tested). A sweep (-m) writes to hydra.sweep.dir."""
    import json
    import os

    where = f"hydra.sweep.dir={tmp_path}" if args.startswith("-m ") else f"hydra.run.dir={tmp_path}"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = train_forked(*args.split(), *SHORT, where, timeout=400, env=env)
    assert proc.returncode == 0, (args, (proc.stdout + proc.stderr)[-3000:])
    summaries = sorted(tmp_path.rglob("summary.json"))
    assert summaries and all(json.loads(s.read_text())["steps"] == 3 for s in summaries), args
    if args == "":  # the README's log of this command: each line is one this run prints, numbers aside
        printed = proc.stdout.splitlines()
        missing = [ln for ln in readme_log() if not any(re.fullmatch(line_shape(ln), p) for p in printed)]
        assert missing == [], (missing, proc.stdout[-3000:])


def readme_log() -> list[str]:
    """The lines of the README's run log (its text block after "`python train.py` prints"), "..." rows out."""
    readme = (docs.ROOT / "README.md").read_text()
    block = readme.split("`python train.py` prints", 1)[1].split("```text\n", 1)[1].split("```", 1)[0]
    return [ln for ln in block.splitlines() if ln.strip() != "..."]


NUMBER = r"\d[\d,]*(?:\.\d+)?(?:e[+-]?\d+)?"


def line_shape(line: str) -> str:
    """A regex for the printed lines ``line`` stands for: any numbers, fingerprint, log time and run
    dir path (``outputs/...``); ``...`` in it stands for anything (a trimmed command)."""
    shape = ""
    for part in re.split(r"(outputs/\S*|\.\.\.|\b[0-9a-f]{16}\b|\d[\d,]*(?:\.\d+)?(?:e[+-]?\d+)?)", line):
        if part.startswith("outputs/"):
            shape += r"\S+"
        elif part == "...":
            shape += ".*"
        elif re.fullmatch(r"[0-9a-f]{16}", part):
            shape += "[0-9a-f]{16}"
        elif re.fullmatch(NUMBER, part):
            shape += NUMBER
        else:
            shape += re.escape(part)
    return r"(?:\[[\d\- :,]+\])?" + shape if line.startswith("[framework]") else shape


def test_line_shape_matches_numbers_and_trims_only() -> None:
    shape = line_shape("[framework][INFO] - step 10/200 | loss 3.9803 | 10,278 tok/s | elapsed 2s, ETA 43s")
    assert re.fullmatch(
        shape,
        "[2026-12-07 18:30:22,181][framework][INFO] - step 1/3 | loss 5.1 | 9 tok/s | elapsed 0s, ETA 1s",
    )
    assert not re.fullmatch(shape, "[framework][INFO] - step 1 | loss 5.1 | 9 tok/s | elapsed 0s, ETA 1s")
    assert re.fullmatch(line_shape("  run dir: outputs/2026-12-07/18-30-17-..."), "  run dir: /tmp/x/run")


@pytest.mark.parametrize("args", sorted(NOT_ON_CPU))
def test_each_first_page_command_not_run_here_plans_and_fits(tmp_path: Path, args: str) -> None:
    """What is not trained here is planned here: its dry run exits 0 and fits its devices (a GPU
    line's on the GPU it names; on the CPU profile the 1B plans 109 of 24 GiB)."""
    hardware = NOT_ON_CPU[args][1]
    test_each_readme_dry_run_exits_0_and_fits_its_devices(tmp_path, f"{args} {hardware} run.dry_run=true")


ARCHITECTURE = docs.ROOT / "docs" / "architecture.md"


def test_the_architecture_map_has_the_layers_of_the_structure_test() -> None:
    """docs/architecture.md's layer table is tests/test_structure.py's LAYERS, in order; the README
    links it."""
    rows = re.findall(r"^\| (\d+) \| `(\w+)` \|", ARCHITECTURE.read_text(), re.M)
    assert [name for _, name in rows] == LAYERS
    assert [int(n) for n, _ in rows] == list(range(1, len(LAYERS) + 1))
    assert "](docs/architecture.md)" in (docs.ROOT / "README.md").read_text()


def test_the_architecture_map_names_code_that_exists_at_its_lines() -> None:
    """Every ``FILE.py:LINE NAME`` of the map is the line where NAME is defined now (``python -m
    framework.docs`` rewrites them), the path to the first step among them; every other file it
    names exists (``NAME`` stands for the new thing's name)."""
    page = ARCHITECTURE.read_text()
    refs = code_refs.references(page)
    assert len(refs) >= 30
    assert [(f, line) for f, line, name in refs if code_refs.line_of(f, name) != line] == []
    path = [f"{f}:{name}" for f, _, name in refs]
    assert path[:2] == ["train.py:main", "framework/launch/entry.py:run_job"]
    assert "framework/parallel/step.py:update" in path and "framework/train/trainer.py:train" in path
    named = set(re.findall(r"`((?:framework|tests|conf|docs|benchmarks|recipes)/[\w./-]+\.(?:py|yaml|md))`", page))
    named |= {f for f, _, _ in refs}
    assert len(named) >= 25
    assert sorted(f for f in named if "NAME" not in f and not (docs.ROOT / f).is_file()) == []


def test_a_moved_or_removed_definition_is_caught() -> None:
    """The check can fail: a wrong line is rewritten to the definition's, a name that is gone raises
    (the map must then be edited by hand)."""
    assert code_refs.render("see framework/train/trainer.py:1 train.") == (
        f"see framework/train/trainer.py:{code_refs.line_of('framework/train/trainer.py', 'train')} train."
    )
    nested = "framework/train/runner.py:1 StepRunner.step.<locals>.attempt"
    assert code_refs.render(nested) != nested and code_refs.render(code_refs.render(nested)) == code_refs.render(nested)
    with pytest.raises(ValueError, match="no definition of no_such_function"):
        code_refs.render("framework/train/trainer.py:10 no_such_function")
    with pytest.raises(ValueError, match="no such file"):
        code_refs.render("framework/train/gone.py:10 train")
