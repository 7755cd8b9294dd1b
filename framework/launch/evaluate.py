"""``python -m framework evaluate RUN|CHECKPOINT|HF_DIR [KEY=VALUE | GROUP=OPTION ...]``: the loss,
perplexity and token count of a model on a data set, printed as one JSON line and written as a
JSON report.

Without data overrides on a run dir or checkpoint, the set is the run's own validation batches (for
a one-rank run at its last step: its final ``val_loss``). With ``data=...`` / ``data.*`` overrides,
or on a Hugging Face folder, it is that whole data set, one pass in order
(framework.generate.evaluate). The config is composed and checked as a launch does it
(framework.launch.source); a bad value, data shorter than one window or an HF folder whose
tokenizer and model disagree are one line (exit 2), and nothing is written.

``mesh=N`` on the command line scores on N local ranks, placed as training places them (any
``sharding`` / ``parallel.*`` layout: FSDP or TP shards, pipeline stages; each rank reads only its
own shards), for a model one device cannot hold: this process checks everything, then launches the
ranks (torch's elastic launcher, as ``train.py mesh=N``); each runs this command with ``--as-rank``,
rank 0 writes the report and this process prints it. The figures are one rank's, to float rounding
(tests/generate/test_evaluate.py). Without ``mesh`` on the command line, one process scores the
whole model, whatever mesh the run trained on.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from framework.config.schema import Config
from framework.record.outputs import check_replaceable

if TYPE_CHECKING:  # torch is imported once the arguments parsed: --help answers without it
    import torch

log = logging.getLogger("framework")
DESCRIPTION = (
    "The loss, perplexity and token count of a model (a run dir, a checkpoint or a Hugging Face folder) "
    "on a data set: the run's own validation batches, or the set that data overrides name; printed as "
    "one JSON line and written as a JSON report."
)
DEVICE_HELP = "where the model runs: cpu, cuda or cuda:N (default: cuda when a GPU is visible, else cpu)"


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m framework evaluate", description=DESCRIPTION)
    parser.add_argument(
        "path", type=Path, help="a run dir (its newest checkpoint), a checkpoint dir or an HF folder"
    )
    parser.add_argument(
        "overrides", nargs="*", help="KEY=VALUE or GROUP=OPTION, as for train.py (data=sft ...)"
    )
    parser.add_argument(
        "--batches", type=int, default=None, help="at most this many micro-batches (default: the whole set)"
    )
    parser.add_argument(
        "--report",
        type=Path,
        default=None,
        help="the JSON report (default: RUN_DIR/evaluate.json for a run, ./evaluate_NAME.json otherwise)",
    )
    parser.add_argument(
        "--force", action="store_true", help="replace a --report file that evaluate did not write"
    )
    parser.add_argument("--device", default=None, help=DEVICE_HELP)
    parser.add_argument("--as-rank", action="store_true", help=argparse.SUPPRESS)  # a launched rank
    return parser.parse_args(argv)


def default_report(path: Path, run_config: Path | None) -> Path:
    if run_config is not None and run_config.parent == path.resolve():
        return path / "evaluate.json"
    return Path.cwd() / f"evaluate_{path.resolve().name}.json"


def main(argv: list[str] | None = None) -> int:
    """Check everything in this process; score here (one rank) or on ``mesh``'s ranks, launched
    on this host (each rank runs this command again with ``--as-rank``); rank 0 writes the report,
    which this process prints."""
    args = parse(argv)
    try:
        cfg, whole_set, device, adapters = checked(args)
        out = (args.report or default_report(args.path, source_run_config(args))).resolve()
        check_replaceable("--report", out, is_report, "a report evaluate wrote", args.force, "evaluate.json")
        world = ranks(args, cfg)
        if args.as_rank or world == 1:
            report = evaluate_here(args, cfg, whole_set, device, adapters)
            if report is not None:
                write(out, report)
            if args.as_rank:
                return 0
        else:
            from framework.launch.ranks import check_local_resources

            check_local_resources(cfg, device)
            out.unlink(missing_ok=True)  # a report left by an earlier command must not pass for this one
            launch_ranks(argv if argv is not None else sys.argv[1:], world, out)
            report = json.loads(out.read_text())
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(report))
    print(f"# report: {out}", file=sys.stderr)
    return 0


def ranks(args: argparse.Namespace, cfg: Config) -> int:
    """The ranks to score on: ``mesh``'s when the command line names it, else one process (a run's
    own mesh is where it trained, not where it is evaluated: a run of 8 GPUs scores on one)."""
    from framework.launch.source import override_keys

    if any(k == "mesh" or k.startswith("mesh.") for k in override_keys(args.overrides)):
        return cfg.mesh.world_size
    if cfg.mesh.world_size > 1:
        log.info(
            "evaluating in one process (the run trained on mesh=%s; name mesh=N to score on N ranks)",
            "x".join(map(str, cfg.mesh.shape)),
        )
    return 1


def source_run_config(args: argparse.Namespace) -> Path | None:
    from framework.checkpoint.import_hf import is_hf_checkpoint
    from framework.generate.decode import find_run_config

    path = args.path.expanduser().resolve()
    return None if is_hf_checkpoint(path) else find_run_config(path)


def checked(args: argparse.Namespace) -> tuple[Config, bool, torch.device, Path | None]:
    """The composed, checked config (as a launch checks it), whether the whole data set is scored,
    the device and, for a LoRA run, the checkpoint of its adapters (framework.launch.source);
    ValueError (one line) for anything wrong, data shorter than one window included."""
    from framework.data.tokenizer import load_tokenizer
    from framework.generate.decode import check_path, parse_device
    from framework.generate.evaluate import check_batches, data_rows
    from framework.launch.source import override_keys, source_config

    if args.batches is not None and args.batches < 1:
        raise ValueError(f"--batches={args.batches} is not valid; valid: 1 or more")
    device = parse_device(args.device)
    check_path(args.path)
    keys = override_keys(args.overrides)
    whole_set = any(k == "data" or k.startswith("data.") for k in keys)
    from framework.checkpoint.import_hf import is_hf_checkpoint

    whole_set = whole_set or is_hf_checkpoint(args.path.expanduser().resolve())
    cfg, _, adapters = source_config(args.path, args.overrides, whole_set)
    check_batches(args.batches, cfg)  # bounded: the batches are built up front
    if whole_set and not args.as_rank:  # short data: one line here, before any rank starts
        data_rows(cfg, load_tokenizer(cfg.tokenizer), rows_limit(args, cfg))
    return cfg, whole_set, device, adapters


def rows_limit(args: argparse.Namespace, cfg: Config) -> int | None:
    return None if args.batches is None else args.batches * cfg.train.micro_batch_size


def evaluate_here(
    args: argparse.Namespace, cfg: Config, whole_set: bool, device: torch.device, adapters: Path | None
) -> dict | None:
    """Score on this rank (one process: no process group); the report on rank 0, else None.
    ``adapters``: a LoRA run's checkpoint (its base is ``model.init_from``)."""
    import contextlib

    import torch

    from framework.data.tokenizer import load_tokenizer
    from framework.generate.evaluate import data_rows, place_model, rank_batches, score
    from framework.parallel.process import process_group

    with contextlib.ExitStack() as stack:
        rank = 0
        if args.as_rank:
            from framework.launch.ranks import die_with_launcher

            die_with_launcher()
            env = stack.enter_context(process_group(torch.device(device.type), cfg.nccl.timeout_s))
            rank, device = env.rank, env.device
        model, dp_rank, dp_size, replicas = place_model(cfg, device, adapters)
        if whole_set:
            rows, what = data_rows(cfg, load_tokenizer(cfg.tokenizer), rows_limit(args, cfg))
            batches, windows = rank_batches(rows, cfg.train.micro_batch_size, dp_rank, dp_size)
            result = score(model, batches, device, windows, replicas)
        else:
            from framework.config.run_values import batch_shape, data_run
            from framework.data.pipeline import build_data

            cfg.train.eval_batches = args.batches or cfg.train.eval_batches
            pipe = build_data(data_run(cfg), batch_shape(cfg.train), dp_rank, dp_size)
            what = f"the run's validation batches: {pipe.description}"
            result = score(model, pipe.val_batches, device, None, replicas)
    if rank != 0:
        return None
    assert cfg.model.init_from is not None or adapters is not None
    lora = {} if adapters is None else {"base": cfg.model.init_from}  # None: the run's seeded init
    return {
        "source": str(args.path.expanduser().resolve()),
        "checkpoint": str(adapters) if adapters is not None else cfg.model.init_from,
        **lora,
        "model": cfg.model.name,
        "data": what,
        "seq_len": cfg.train.seq_len,
        "mesh": list(cfg.mesh.shape),
        "loss": result.loss,
        "perplexity": result.perplexity,
        "tokens": result.tokens,
        "windows": result.windows,
        # The names training logs (val_loss / val_ppl), for the same figure.
        "val_loss": result.loss,
        "val_ppl": result.perplexity,
    }


# The keys every report holds (``evaluate_here``): how a file at --report is known for one evaluate wrote.
REPORT_KEYS = frozenset({"source", "checkpoint", "model", "data", "loss", "perplexity", "tokens"})


def is_report(path: Path) -> bool:
    """Whether ``path`` holds a report evaluate wrote (a JSON object with ``REPORT_KEYS``): the only
    file --report replaces without --force."""
    from framework.record.outputs import text_of

    text = text_of(path)
    try:
        report = json.loads(text) if text is not None else None
    except ValueError:
        return False
    return isinstance(report, dict) and REPORT_KEYS <= report.keys()


def write(out: Path, report: dict) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")


def launch_ranks(argv: list[str], world: int, out: Path) -> None:
    """This command on ``world`` local ranks (``--as-rank``, the report at ``out``); ValueError
    (one line) when a rank failed. The launcher's environment is this process's again afterwards."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    from framework.launch.ranks import isolated_environ, launch_local

    argv = [a for a in argv if a != "--as-rank"]
    rank_args = ("-m", "framework.launch.evaluate", *argv, "--report", str(out), "--as-rank")
    with isolated_environ():
        try:
            launch_local(world, 0, f"evaluate-{os.getpid()}", rank_args)
        except ChildFailedError as e:
            first = next(iter(e.failures.values()))
            raise ValueError(
                f"evaluate on {world} ranks failed: rank {first.local_rank} exited with {first.exitcode} "
                "(its traceback is above)"
            ) from None
    if not out.is_file():
        raise ValueError(f"evaluate on {world} ranks ended without writing {out}")


if __name__ == "__main__":
    code = main()
    if "--as-rank" in sys.argv[1:]:
        # A rank ends with os._exit (framework.parallel.process.finish): its group is destroyed, but
        # gloo's threads can still abort the interpreter's shutdown ("terminate called without an
        # active exception", exit -6: 1 in 6 two-rank evaluations here).
        from framework.parallel.process import finish

        finish(code)
    sys.exit(code)
