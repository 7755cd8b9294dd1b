"""The run PNG and the sweep comparison PNG, drawn from real metrics files."""

from __future__ import annotations

from pathlib import Path

import pytest

from framework.record.metrics import Metrics, read_metrics
from framework.train.plots import plot_run, plot_sweep, run_panels, sweep_curves

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _write_run(run_dir: Path, mfu: bool) -> None:
    m = Metrics(run_dir, enabled=True, total_steps=6, start_step=0, progress_bar=False)
    m.log({"step": 0, "val_loss": 5.5})
    for step in (2, 4, 6):
        row = {"step": step, "loss": 6.0 - step / 2, "tokens_per_s": 1000.0 * step}
        row |= {"lr": 1e-3 * step / 6, "grad_norm": 2.0 / step}
        if mfu:
            row["mfu"] = 0.1 * step
        m.log(row)
    m.log({"step": 6, "event": "checkpoint", "detail": "saved"})
    m.log({"step": 6, "val_loss": 3.5})
    m.close()


def _panels(path: Path) -> int:
    import matplotlib.image

    img = matplotlib.image.imread(path)
    return img.shape[0]  # height grows with the number of panels


def test_plot_run_writes_a_png_with_an_mfu_panel_only_when_measured(tmp_path: Path) -> None:
    with_mfu, without = tmp_path / "a", tmp_path / "b"
    for d, mfu in ((with_mfu, True), (without, False)):
        d.mkdir()
        _write_run(d, mfu)
    p1, p2 = plot_run(with_mfu), plot_run(without)
    assert p1 == with_mfu / "metrics.png" and p1.read_bytes()[:8] == PNG_MAGIC
    assert p2.read_bytes()[:8] == PNG_MAGIC
    assert _panels(p1) > _panels(p2)  # one panel more
    titles = ["loss", "tokens/s", "learning rate", "grad norm"]
    assert [t for t, _ in run_panels(read_metrics(with_mfu))] == [*titles, "MFU"]
    assert [t for t, _ in run_panels(read_metrics(without))] == titles


def test_plot_run_refuses_a_run_without_losses(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="nothing to plot"):
        plot_run(tmp_path)


def test_plot_sweep(tmp_path: Path) -> None:
    """Bars per job, and the jobs' loss curves overlaid (read from each run dir); a failed job
    without metrics has no curve."""
    for d in ("0", "1"):
        (tmp_path / d).mkdir()
    _write_run(tmp_path / "0", mfu=False)
    jobs = [
        {"job": "0", "overrides": "sharding=ddp", "status": "ok", "final_loss": 4.0, "tokens_per_s": 900.0},
        {"job": "1", "overrides": "sharding=fsdp", "status": "failed", "final_loss": None},
    ]
    jobs = [{**j, "run_dir": str(tmp_path / j["job"])} for j in jobs]
    assert sweep_curves(jobs) == {"#0 sharding=ddp": ([2, 4, 6], [5.0, 4.0, 3.0])}
    out = plot_sweep(jobs, tmp_path / "s.png")
    assert out.read_bytes()[:8] == PNG_MAGIC
    flat = plot_sweep([{**j, "run_dir": None} for j in jobs], tmp_path / "flat.png")
    assert _panels(out) > _panels(flat)  # the curves' axis below the bars
