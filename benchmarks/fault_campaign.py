"""Fault campaign: a seeded schedule of random faults over the layouts that resume bitwise; each run is
resumed and its final checkpoint (weights, AdamW moments, step counts, data position) and last loss
are compared bit for bit with an unbroken run of the same config.

    python benchmarks/fault_campaign.py --seed S --faults N [--layouts one,fsdp,...] [--kinds ...]

Prints one line per fault and ``K/N faults survived bitwise`` (and, per failure, what happened);
exits 1 unless every fault survived. The model is torchft's and Megatron's fault injectors: a
fault of a random kind at a random (seeded) time, then recovery as an operator would do it (relaunch
the same command). What is real: ``train.py`` launches (forked from this process, tests/entry.py:
the launcher and its gloo ranks are the real ones), signals to the real launcher or rank processes,
DCP files on disk, a full disk (a small tmpfs in an unprivileged user + mount namespace, as
tests/checkpoint/test_checkpoint.py's ``_tmpfs``). The kinds:

- ``kill_rank``: SIGKILL of one rank after a random step (``run.fault_kill_at_step``); on several
  ranks the launcher restarts them (``run.max_restarts=1``) and they resume;
- ``kill_launcher``, ``sigterm``, ``sigint``: SIGKILL / SIGTERM (preemption) / Ctrl-C to the
  launcher at a random time of the training; then a relaunch;
- ``kill_in_save``: SIGKILL (of a rank, or of the one process) while a save's ``step_N.tmp`` is
  being written, N a random save;
- ``full_disk``: ``checkpoint.dir`` on a tmpfs that fills at a random save (``checkpoint.keep_last=0``);
  the disk is then grown (remounted) and the run relaunched;
- ``corrupt``: a rank SIGKILLed at a random step, then one random file of the newest checkpoint
  truncated or one random bit of it flipped; then a relaunch;
- ``rundir_deleted``: the run dir deleted at a random time; then a relaunch (from scratch);
- ``two_resumes``: the launcher SIGKILLed, then two relaunches at once (one gets the checkpoint
  lock, the other is refused).

"A random time": a random delay after the first logged step, up to most of the unbroken run's
training time (measured from its metrics).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from tests.entry import ForkedRun, start_forked  # noqa: E402

# The tiny config every layout shares (tests/train/test_elastic.py's): deterministic kernels, a save
# every 4 steps; the warmup outlasts the run, so the LR of a step does not depend on anything else.
STEPS, EVERY = 24, 4
BASE = (
    "train.seq_len=32",
    "train.global_batch_size=8",
    "train.micro_batch_size=2",
    "train.eval_every=0",
    "train.log_every=1",
    f"train.steps={STEPS}",
    "train.warmup_steps=40",
    f"checkpoint.every_steps={EVERY}",
    "run.deterministic=true",
    "freeze=none",
    "logger.plot=false",
)
# Each layout's overrides; checkpoint=sync unless it names another.
LAYOUTS: dict[str, tuple[str, ...]] = {
    "one": ("mesh=1",),
    "fsdp": ("mesh=2", "sharding=fsdp"),
    "pp_dp": ("mesh=4", "parallel.pp=2", "parallel.dp_shard=2", "train.micro_batch_size=1"),
    "async": ("mesh=2", "sharding=ddp", "checkpoint=async"),
    "lora": ("mesh=2", "sharding=fsdp", "peft=lora", "peft.targets=[wq,wk,wv,wo]"),
    "moe_ep2": ("recipe=qwen3_moe_tiny", "mesh=2", "sharding=fsdp", "parallel.ep=2"),
}
KINDS = (
    "kill_rank",
    "kill_launcher",
    "sigterm",
    "sigint",
    "kill_in_save",
    "full_disk",
    "corrupt",
    "rundir_deleted",
    "two_resumes",
)
TIMEOUT_S = 600.0


def _env() -> dict[str, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    env.pop("RUN_STAMP", None)
    return env


def overrides(layout: str) -> list[str]:
    own = list(LAYOUTS[layout])
    ckpt = [] if any(o.startswith("checkpoint=") for o in own) else ["checkpoint=sync"]
    return [*own, *ckpt, *BASE]


def launch(run: Path, layout: str, *extra: str, log: Path) -> ForkedRun:
    """``python train.py`` of ``layout`` into ``run`` (forked from this process, tests/entry.py)."""
    return start_forked(f"hydra.run.dir={run}", *overrides(layout), *extra, env=_env(), log=log)


def finish(proc: ForkedRun) -> int:
    try:
        return proc.wait(TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        return -9


# --- what a run left ------------------------------------------------------------------------------


def rows(run: Path) -> list[dict]:
    path = run / "metrics.jsonl"
    if not path.is_file():
        return []
    out = []
    for line in path.read_text().splitlines():
        with contextlib.suppress(ValueError):
            out.append(json.loads(line))
    return out


def last_loss(run: Path) -> float | None:
    losses = [r["loss"] for r in rows(run) if "loss" in r and r.get("step") == STEPS]
    return losses[-1] if losses else None


def resumed_from(run: Path) -> list[int]:
    return [r["step"] for r in rows(run) if r.get("event") == "resumed"]


def final_step(root: Path) -> Path:
    return root / f"step_{STEPS:06d}"


def tensors(step_dir: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a DCP checkpoint (model and optimizer, every rank's shards), read here."""
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

    from framework.checkpoint.state import SafeReader

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assumes a single process": it is one
        nested = _load_state_dict_from_keys(storage_reader=SafeReader(step_dir))

    def flat(d: dict, prefix: str = "") -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        for k, v in d.items():
            out.update(flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
        return out

    return flat(nested)


def compare(ours: Path, theirs: Path, ours_run: Path, theirs_run: Path) -> str | None:
    """None when the final checkpoints are bitwise equal (every tensor, the data position) and so is
    the last step's loss; else what differs."""
    if not (ours / ".metadata").is_file():
        return f"no final checkpoint {ours}"
    a, b = tensors(ours), tensors(theirs)
    if set(a) != set(b):
        return f"other tensors: {sorted(set(a) ^ set(b))[:3]}"
    differ = [k for k in a if not torch.equal(a[k], b[k])]
    if differ:
        return f"{len(differ)} of {len(a)} tensors differ, e.g. {differ[:2]}"
    data = [json.loads((d / "extra.json").read_text())["extra"].get("data") for d in (ours, theirs)]
    if data[0] != data[1]:
        return f"data position {data[0]} != {data[1]}"
    if last_loss(ours_run) != last_loss(theirs_run):
        return f"step {STEPS} loss {last_loss(ours_run)!r} != {last_loss(theirs_run)!r}"
    return None


# --- the schedule ---------------------------------------------------------------------------------


@dataclass
class Fault:
    index: int
    layout: str
    kind: str
    rng: random.Random
    detail: list[str] = field(default_factory=list)
    missed: str | None = None  # why the fault never landed (the run ended first): not a survival

    def name(self) -> str:
        return f"#{self.index} {self.kind} on {self.layout}"


def schedule(seed: int, n: int, layouts: list[str], kinds: list[str]) -> list[Fault]:
    """``n`` faults drawn from ``seed``: the kinds in shuffled rounds (each kind once per round, so
    every kind comes up once ``n`` reaches their number), each on a random layout, each with its own
    generator for its time and target. ``full_disk`` is left out where no tmpfs can be mounted."""
    rng = random.Random(seed)
    usable = [k for k in kinds if k != "full_disk" or unshare_works()] or ["kill_launcher"]
    order: list[str] = []
    while len(order) < n:
        order += rng.sample(usable, len(usable))
    return [Fault(i, rng.choice(layouts), order[i], random.Random(rng.getrandbits(64))) for i in range(n)]


@dataclass
class Reference:
    run: Path
    train_s: float  # time from the first logged step to the last
    checkpoint_bytes: int  # the final checkpoint's files


def unbroken(work: Path, layout: str, cache: dict[str, Reference]) -> Reference:
    if layout not in cache:
        run = work / f"unbroken_{layout}"
        shutil.rmtree(run, ignore_errors=True)
        code = finish(launch(run, layout, log=work / f"unbroken_{layout}.log"))
        if code != 0:
            raise RuntimeError(f"the unbroken {layout} run exited {code}: {work / f'unbroken_{layout}.log'}")
        times = [r["time"] for r in rows(run) if "loss" in r]
        size = sum(p.stat().st_size for p in final_step(run / "checkpoints").rglob("*") if p.is_file())
        cache[layout] = Reference(run, max(times) - min(times), size)
    return cache[layout]


# --- injecting ------------------------------------------------------------------------------------


def wait_for_training(proc: ForkedRun, run: Path) -> bool:
    """Until the run logged its first step (True), or ended first (False)."""
    deadline = time.monotonic() + TIMEOUT_S
    while not any("loss" in r for r in rows(run)):
        if proc.poll() is not None or time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def at_random_time(
    f: Fault, proc: ForkedRun, run: Path, ref: Reference, act: Callable[[], None]
) -> list[int]:
    """``act()`` after a random delay into the training (up to 60% of the unbroken run's training
    time, so that it lands before the end); the rank processes there were just before (to wait for)."""
    delay = f.rng.uniform(0.0, 0.6 * ref.train_s)
    if not wait_for_training(proc, run):
        f.missed = "the run ended before its first step"
        return []
    time.sleep(delay)
    ranks = rank_pids(proc.pid)
    if proc.poll() is not None:
        f.missed = f"the run ended within {delay:.2f}s of its first step"
        return []
    steps = [r["step"] for r in rows(run) if "loss" in r]
    act()
    f.detail.append(f"at {delay:.2f}s (step {max(steps, default=0)} logged)")
    return ranks


def wait_gone(pids: list[int], timeout_s: float = 60.0) -> None:
    """Until the processes ``pids`` have exited (ranks of a SIGKILLed launcher die with it, within
    seconds: framework.launch.ranks.die_with_launcher); the operator relaunches after that."""
    deadline = time.monotonic() + timeout_s
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)


def alive(pid: int) -> bool:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    return "State:\tZ" not in status  # a zombie has exited


def rank_pids(launcher: int) -> list[int]:
    """The launcher's rank processes (framework.launch.worker), from /proc."""
    out = []
    for task in Path(f"/proc/{launcher}/task").glob("*"):
        with contextlib.suppress(OSError):
            for c in (task / "children").read_text().split():
                cmd = Path(f"/proc/{c}/cmdline").read_bytes()
                if b"framework.launch.worker" in cmd:
                    out.append(int(c))
    return sorted(out)


def world(layout: str) -> int:
    mesh = next(o for o in LAYOUTS[layout] if o.startswith("mesh="))
    return int(mesh.removeprefix("mesh="))


def relaunch(f: Fault, run: Path, work: Path, *extra: str, tag: str = "resume") -> int:
    code = finish(launch(run, f.layout, *extra, log=work / f"{run.name}.{tag}.log"))
    f.detail.append(f"{tag} exit {code}")
    return code


def inject(f: Fault, run: Path, work: Path, ref: Reference) -> Path:
    """Run ``f``'s layout into ``run`` with the fault, then recover; the root of the final checkpoint."""
    log = work / f"{run.name}.fault.log"
    many = world(f.layout) > 1
    root = run / "checkpoints"
    if f.kind == "full_disk":
        return full_disk(f, run, work, ref)
    if f.kind in ("kill_rank", "corrupt"):
        step = (
            f.rng.randint(2, STEPS - 1) if f.kind == "kill_rank" else f.rng.randint(2 * EVERY + 1, STEPS - 1)
        )
        rank = f.rng.randrange(world(f.layout))
        restarts = "1" if many and f.kind == "kill_rank" else "0"
        extra = (f"run.fault_kill_at_step={step}", f"run.fault_rank={rank}", f"run.max_restarts={restarts}")
        code = finish(launch(run, f.layout, *extra, log=log))
        f.detail.append(f"rank {rank} SIGKILLed at step {step}, exit {code}")
        if f.kind == "corrupt":
            f.detail.append(spoil(f, root))
    elif f.kind in ("kill_launcher", "sigterm", "sigint", "rundir_deleted", "two_resumes"):
        proc = launch(run, f.layout, log=log)
        how = {"sigterm": signal.SIGTERM, "sigint": signal.SIGINT}.get(f.kind, signal.SIGKILL)
        if f.kind == "rundir_deleted":
            ranks = at_random_time(f, proc, run, ref, lambda: shutil.rmtree(run, ignore_errors=True))
        else:
            ranks = at_random_time(f, proc, run, ref, lambda: proc.send_signal(how))
        f.detail.append(f"exit {finish(proc)}")
        wait_gone(ranks)
    elif f.kind == "kill_in_save":
        kill_in_save(f, run, log)
    else:
        raise ValueError(f"--kinds: {f.kind!r} is not a fault kind; valid: {', '.join(KINDS)}")
    if f.kind == "two_resumes":
        two = [launch(run, f.layout, log=work / f"{run.name}.resume{i}.log") for i in (1, 2)]
        codes = [finish(p) for p in two]
        f.detail.append(f"two resumes at once exit {codes[0]} and {codes[1]}")
    if not (final_step(root) / ".metadata").is_file():
        relaunch(f, run, work)
    return root


def kill_in_save(f: Fault, run: Path, log: Path) -> None:
    """SIGKILL a rank (or the one process) as soon as the save of a random step is being written."""
    step = EVERY * f.rng.randint(1, STEPS // EVERY - 1)
    tmp = run / "checkpoints" / f"step_{step:06d}.tmp"
    many = world(f.layout) > 1
    rank = f.rng.randrange(world(f.layout))
    proc = launch(run, f.layout, *(["run.max_restarts=1"] if many else []), log=log)
    deadline = time.monotonic() + TIMEOUT_S
    while not tmp.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            f.missed = f"no {tmp.name} seen"
            break
        time.sleep(0.0002)
    else:
        pids = rank_pids(proc.pid) if many else [proc.pid]
        victim = pids[rank] if rank < len(pids) else proc.pid
        with contextlib.suppress(ProcessLookupError):
            os.kill(victim, signal.SIGKILL)
        left = "left" if tmp.exists() else "gone"
        f.detail.append(
            f"{'rank ' + str(rank) if many else 'the process'} SIGKILLed writing {tmp.name} ({left})"
        )
    f.detail.append(f"exit {finish(proc)}")


def spoil(f: Fault, root: Path) -> str:
    """Truncate one random file of the newest checkpoint, or flip one random bit of it."""
    steps = sorted(p for p in root.glob("step_*") if p.is_dir() and not p.name.endswith((".tmp", ".del")))
    if not steps:
        return "no checkpoint to spoil"
    files = sorted(p for p in steps[-1].rglob("*") if p.is_file() and p.stat().st_size > 0)
    victim = f.rng.choice(files)
    data = bytearray(victim.read_bytes())
    if f.rng.random() < 0.5:
        cut = f.rng.randrange(len(data))
        victim.write_bytes(bytes(data[:cut]))
        return f"truncated {victim.relative_to(root)} to {cut} of {len(data)} bytes"
    at, bit = f.rng.randrange(len(data)), f.rng.randrange(8)
    data[at] ^= 1 << bit
    victim.write_bytes(bytes(data))
    return f"flipped bit {bit} of byte {at} of {victim.relative_to(root)}"


_UNSHARE: list[bool] = []


def unshare_works() -> bool:
    """An unprivileged user + mount namespace can mount a tmpfs here (tests/checkpoint/test_checkpoint.py)."""
    if not _UNSHARE:
        probe = subprocess.run(
            [
                "unshare",
                "-rm",
                "sh",
                "-c",
                "mount -t tmpfs -o size=64k tmpfs /mnt || mount -t tmpfs tmpfs /tmp",
            ],
            capture_output=True,
        )
        _UNSHARE.append(shutil.which("unshare") is not None and probe.returncode == 0)
    return _UNSHARE[0]


def full_disk(f: Fault, run: Path, work: Path, ref: Reference) -> Path:
    """``checkpoint.dir`` on a tmpfs with room for a random number of checkpoints (all kept), then
    grown to 256 MiB and the run relaunched, in one mount namespace (the tmpfs lives as long as it);
    the disk's files are copied out for the comparison. Real ``python train.py`` processes: a fork
    cannot enter the namespace."""
    fits = f.rng.randint(1, STEPS // EVERY - 1)
    size = ((fits + 0.5) * ref.checkpoint_bytes + 256 * 1024) // 4096 * 4096
    disk, copy = work / f"{run.name}.disk", run / "disk_copy"
    disk.mkdir(parents=True, exist_ok=True)
    train = [sys.executable, str(ROOT / "train.py"), f"hydra.run.dir={run}", *overrides(f.layout)]
    train += [f"checkpoint.dir={disk}", "checkpoint.keep_last=0"]
    q = shlex.quote
    script = (
        f"mount -t tmpfs -o size={int(size)} tmpfs {q(str(disk))} || exit 97\n"
        f"{shlex.join(train)} > {q(str(work / (run.name + '.fault.log')))} 2>&1; echo first=$?\n"
        f"mount -o remount,size=256m {q(str(disk))} || exit 98\n"
        f"{shlex.join(train)} > {q(str(work / (run.name + '.resume.log')))} 2>&1; echo second=$?\n"
        f"cp -a {q(str(disk))}/. {q(str(copy))}/ 2>/dev/null || mkdir -p {q(str(copy))}\n"
    )
    copy.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run(
        ["unshare", "-rm", "sh", "-c", script], capture_output=True, text=True, cwd=ROOT, env=_env()
    )
    f.detail.append(f"tmpfs of {int(size)} bytes (room for {fits} checkpoints of {ref.checkpoint_bytes})")
    f.detail.append(
        " ".join(proc.stdout.split()) or f"namespace exit {proc.returncode}: {proc.stderr[-200:]}"
    )
    failed = [r["step"] for r in rows(run) if r.get("event") == "checkpoint_failed"]
    f.detail.append(f"saves failed at steps {failed}")
    return copy


def run_one(f: Fault, work: Path, cache: dict[str, Reference]) -> str | None:
    """Inject ``f``, recover, compare; None when it survived bitwise, else what happened."""
    ref = unbroken(work, f.layout, cache)
    run = work / f"fault_{f.index:03d}"
    shutil.rmtree(run, ignore_errors=True)
    root = inject(f, run, work, ref)
    if resumed_from(run):
        f.detail.append(f"resumed from step {', '.join(map(str, resumed_from(run)))}")
    if f.missed is not None:
        return f"missed: {f.missed}"
    return compare(final_step(root), final_step(ref.run / "checkpoints"), run, ref.run)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--faults", type=int, default=10)
    parser.add_argument("--layouts", default=",".join(LAYOUTS), help=f"of {', '.join(LAYOUTS)}")
    parser.add_argument("--kinds", default=",".join(KINDS), help=f"of {', '.join(KINDS)}")
    parser.add_argument(
        "--work", type=Path, default=None, help="where the runs go (default: a temporary dir)"
    )
    args = parser.parse_args(argv)
    layouts, kinds = args.layouts.split(","), args.kinds.split(",")
    bad = [x for x in layouts if x not in LAYOUTS] + [x for x in kinds if x not in KINDS]
    if bad or args.faults < 1:
        what = f"--faults={args.faults}" if not bad else repr(bad[0])
        print(
            f"error: {what} is not valid; valid: --faults >= 1, --layouts of {', '.join(LAYOUTS)}, "
            f"--kinds of {', '.join(KINDS)}",
            file=sys.stderr,
        )
        return 2
    with contextlib.ExitStack() as stack:
        work = args.work or Path(stack.enter_context(tempfile.TemporaryDirectory()))
        work.mkdir(parents=True, exist_ok=True)
        return campaign(schedule(args.seed, args.faults, layouts, kinds), work)


def campaign(faults: list[Fault], work: Path) -> int:
    cache: dict[str, Reference] = {}
    failures: list[tuple[Fault, str]] = []
    started = time.monotonic()
    for f in faults:
        t0 = time.monotonic()
        try:
            problem = run_one(f, work, cache)
        except Exception as e:  # noqa: BLE001 - a campaign reports every fault, whatever broke
            problem = f"{type(e).__name__}: {e}"
        state = "survived bitwise" if problem is None else f"FAILED: {problem}"
        print(f"{f.name()}: {state} [{'; '.join(f.detail)}] ({time.monotonic() - t0:.0f}s)", flush=True)
        if problem is not None:
            failures.append((f, problem))
    n = len(faults)
    print(f"{n - len(failures)}/{n} faults survived bitwise ({time.monotonic() - started:.0f}s)")
    for f, problem in failures:
        print(f"  {f.name()}: {problem}; {'; '.join(f.detail)}")
    return 0 if not failures else 1


if __name__ == "__main__":
    sys.exit(main())
