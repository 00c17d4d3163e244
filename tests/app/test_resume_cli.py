"""Crashes: SIGKILL mid-run then resume is bit-exact; a checkpoint is never half-written.

The resume test runs ``train.py`` three times: uninterrupted, killed with SIGKILL after its
first checkpoint, and resumed from that checkpoint to the same ``max_steps`` in the killed
run's own directory (the README's pattern for multi-node jobs), whose logs must then read as
the uninterrupted run's. Checkpoints taken inside an epoch and at its end resume exactly too
(in-process runs): the recipes' training loader holds its place in the epoch's order
(``recipes/_sampling.py``).
"""

from __future__ import annotations

import io
import signal
import subprocess
import sys
import time
from pathlib import Path

import _cli_procs
import pytest
import torch
from _checkpoint_trees import differences

from amp_plugin.lightning.checkpoint_io import AtomicCheckpointIO

ROOT = Path(__file__).resolve().parents[2]


def epoch_length() -> int:
    from amp_plugin.recipes.digits import DigitsRecipe

    return len(DigitsRecipe().train_dataloader())


def start(args: list[str], run_dir: Path, log_name: str | None = None) -> subprocess.Popen:
    """``train.py ARGS`` into ``run_dir``, logging to ``<log_name or run_dir.name>.log`` beside it."""
    log = run_dir.parent / f"{log_name or run_dir.name}.log"
    return _cli_procs.start([*args, f"hydra.run.dir={run_dir}"], run_dir.parent, log)


def finish(proc: subprocess.Popen, run_dir: Path, timeout: float = 300, log_name: str | None = None) -> None:
    proc.wait(timeout=timeout)
    assert proc.returncode == 0, (run_dir.parent / f"{log_name or run_dir.name}.log").read_text()[-3000:]


def load(path: Path) -> dict:
    return torch.load(path, map_location="cpu", weights_only=False)


@pytest.mark.slow
def test_sigkill_then_resume_is_bit_exact(tmp_path):
    k = epoch_length()  # 23 batches with the default digits split
    common = [
        "trainer.max_steps=" + str(3 * k),
        f"callbacks.model_checkpoint.every_n_train_steps={k}",
        "scaler.growth_interval=10",  # the scale grows across the kill: a forgotten scale would show
        f"+fault.inject_inf_at=[5,{k + 7}]",  # a skipped step before the kill and one after
        "trainer.enable_progress_bar=false",
        "plot=false",
    ]
    full_dir, victim_dir = tmp_path / "full", tmp_path / "victim"
    resumed_dir = victim_dir  # resumed in place
    full = start(common, full_dir)
    victim = start(
        [
            *common,
            *_cli_procs.throttle(after_step=k, seconds=0.5),
        ],
        victim_dir,
    )
    last = victim_dir / "checkpoints" / "last.ckpt"
    deadline = time.monotonic() + 240
    while not last.exists() and victim.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(1.0)  # a few steps past the checkpoint: logged rows that the resume must drop
    victim.send_signal(signal.SIGKILL)
    victim.wait(timeout=30)
    assert victim.returncode == -signal.SIGKILL, (tmp_path / "victim.log").read_text()[-3000:]
    assert not (victim_dir / "summary.json").exists()
    assert load(last)["global_step"] == k

    resumed = start([*common, f"ckpt_path={last}"], resumed_dir, log_name="resumed")
    finish(resumed, resumed_dir, log_name="resumed")
    finish(full, full_dir)

    expected, got = load(full_dir / "checkpoints" / "last.ckpt"), load(resumed_dir / "checkpoints" / "last.ckpt")
    assert expected["global_step"] == got["global_step"] == 3 * k
    for key in ("state_dict", "optimizer_states", "lr_schedulers", "amp_plugin", "epoch", "global_step"):
        assert differences(expected[key], got[key]) == [], key
    scaler = got["amp_plugin"]["scaler"]
    assert scaler["skipped_steps"] == 2 and scaler["scale"] > 2.0**16  # backed off twice, grew past its start
    assert "master_params" in got["optimizer_states"][0]  # the FP32 masters are compared too
    # The resumed run keeps what was logged up to the checkpoint, drops what the killed run logged
    # after it, and appends: every log reads as the uninterrupted run's.
    for name in ("logs/scale_events.csv", "logs/metrics.csv", "training_curves.csv"):
        assert (full_dir / name).read_text() == (resumed_dir / name).read_text(), name


QUIET = ["trainer.enable_progress_bar=false", "plot=false"]


def _resumed_equals_uninterrupted(tmp_path, compose_config, common: list[str], checkpoint: str, step: int) -> None:
    """Train ``common`` uninterrupted, then again from its ``checkpoints/<checkpoint>`` (at ``step``): the
    same weights, optimizer state, amp_plugin state and step at the end, every bit."""
    from amp_plugin.app.run import train

    train(compose_config(*common, output_dir=tmp_path / "full"))
    saved = tmp_path / "full" / "checkpoints" / checkpoint
    assert load(saved)["global_step"] == step
    train(compose_config(*common, f"ckpt_path={saved}", output_dir=tmp_path / "resumed"))
    expected, got = (load(tmp_path / d / "checkpoints" / "last.ckpt") for d in ("full", "resumed"))
    for key in ("state_dict", "optimizer_states", "amp_plugin", "global_step"):
        assert differences(expected[key], got[key]) == [], key


@pytest.mark.slow
def test_resume_from_an_epoch_end_checkpoint_is_bit_exact(tmp_path, compose_config):
    """The default callbacks' per-epoch checkpoints: resumed from one, Lightning 2.6 passes ``set_epoch`` one
    more than the epoch it runs, for every epoch after; the recipes' loader holds the epoch it read in the
    checkpoint and counts on from it (two epochs after the resume here)."""
    k = epoch_length()
    common = [f"trainer.max_steps={3 * k}", "callbacks.model_checkpoint.save_top_k=-1", "trainer.limit_val_batches=1"]
    _resumed_equals_uninterrupted(tmp_path, compose_config, [*common, *QUIET], f"epoch0-step{k}.ckpt", k)


@pytest.mark.slow
def test_resume_from_a_checkpoint_inside_an_epoch_is_bit_exact(tmp_path, compose_config):
    """A checkpoint seven batches into the second epoch (as a SIGTERM or ``every_n_train_steps`` leaves one):
    the resumed run trains on that epoch's batches after the seventh, in its order, not on its first ones again."""
    k = epoch_length()
    common = [
        f"trainer.max_steps={3 * k + 3}",
        f"callbacks.model_checkpoint.every_n_train_steps={k + 7}",
        "callbacks.model_checkpoint.save_top_k=-1",
        "trainer.limit_val_batches=1",
        *QUIET,
    ]
    _resumed_equals_uninterrupted(tmp_path, compose_config, common, f"epoch1-step{k + 7}.ckpt", k + 7)


# ---------------------------------------------------------------------------------- atomic checkpoint writes
def _crashing_save(real_save):
    """A ``torch.save`` that writes the first half of the file, then fails as a killed writer would."""

    def save(obj, f, *args, **kwargs):
        buffer = io.BytesIO()
        real_save(obj, buffer, *args, **kwargs)
        data = buffer.getvalue()
        f.write(data[: len(data) // 2])
        f.flush()
        raise OSError("simulated crash halfway through a checkpoint write")

    return save


def test_a_checkpoint_write_that_fails_halfway_leaves_the_previous_one(tmp_path, monkeypatch, compose_config):
    from amp_plugin.app.run import train

    result = train(compose_config("trainer.max_steps=3", "trainer.limit_val_batches=1", *QUIET, output_dir=tmp_path))
    trainer = result["trainer"]
    assert isinstance(trainer.strategy.checkpoint_io, AtomicCheckpointIO)  # what train.py saves with
    folder = tmp_path / "checkpoints"
    last = folder / "last.ckpt"
    before = last.read_bytes()
    files = sorted(p.name for p in folder.iterdir())

    monkeypatch.setattr(torch, "save", _crashing_save(torch.save))
    with pytest.raises(OSError, match="simulated crash"):
        trainer.save_checkpoint(last)
    monkeypatch.undo()
    assert last.read_bytes() == before and load(last)["global_step"] == 3
    assert sorted(p.name for p in folder.iterdir()) == files  # no partial file left behind

    # What the failed write would have produced in place does not load as a checkpoint.
    half = tmp_path / "half.ckpt"
    trainer.save_checkpoint(tmp_path / "full.ckpt")
    data = (tmp_path / "full.ckpt").read_bytes()
    half.write_bytes(data[: len(data) // 2])
    with pytest.raises(RuntimeError):
        load(half)


_KILLED_WRITER = """
import io, os, signal, sys
import torch
from amp_plugin.lightning.checkpoint_io import AtomicCheckpointIO

path = sys.argv[1]
writer = AtomicCheckpointIO()
writer.save_checkpoint({"state_dict": {"w": torch.zeros(1000)}, "global_step": 1}, path)
real_save = torch.save

def dying_save(obj, f, *args, **kwargs):
    buffer = io.BytesIO()
    real_save(obj, buffer, *args, **kwargs)
    data = buffer.getvalue()
    f.write(data[: len(data) // 2])
    f.flush()
    os.fsync(f.fileno())
    os.kill(os.getpid(), signal.SIGKILL)

torch.save = dying_save
writer.save_checkpoint({"state_dict": {"w": torch.ones(100000)}, "global_step": 2}, path)
"""


@pytest.mark.slow
def test_sigkill_during_a_checkpoint_write_leaves_the_previous_one(tmp_path):
    folder = tmp_path / "checkpoints"
    last = folder / "last.ckpt"
    script = tmp_path / "writer.py"
    script.write_text(_KILLED_WRITER)
    proc = subprocess.run([sys.executable, str(script), str(last)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
    assert load(last)["global_step"] == 1  # the previous checkpoint, whole
    (partial,) = [p for p in folder.iterdir() if p != last]
    # Hidden, never *.ckpt and never "last": no glob, ModelCheckpoint or ckpt_path="last" picks it up.
    assert partial.name.startswith(".partial-") and partial.suffix == ".tmp" and "last" not in partial.name
    assert partial.stat().st_size > 0
    with pytest.raises(RuntimeError):
        load(partial)
