"""DDP through the CLI: two CPU processes (gloo) train, and an overflow on one rank is skipped by both.

Each rank's final state comes out through the CLI's own extension point: a callback added
with ``+callbacks.rank_state._target_=test_ddp_cli.SaveRankState`` (this module is on the
workers' PYTHONPATH) saves that rank's parameters, scale and skipped steps.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from amp_plugin.lightning import pl

ROOT = Path(__file__).resolve().parents[2]
TESTS = Path(__file__).resolve().parent


class SaveRankState(pl.Callback):
    """At the end of training, save this rank's view of the run to ``out_dir/rank<r>.pt``."""

    def __init__(self, out_dir: str) -> None:
        self.out_dir = out_dir
        self.skipped_at: list[int] = []

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.precision_plugin.scaler.last_step_skipped:
            self.skipped_at.append(trainer.global_step - 1)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        injector = next(c for c in trainer.callbacks if type(c).__name__ == "FaultInjector")
        optimizer = trainer.optimizers[0]
        torch.save(
            {
                "params": {name: p.detach().clone() for name, p in pl_module.named_parameters()},
                "masters": [m.detach().clone() for m in optimizer.master_params()],
                "scale": trainer.precision_plugin.scaler.get_scale(),
                "skipped_at": self.skipped_at,
                "injected": injector.injected,
                "global_step": trainer.global_step,
            },
            os.path.join(self.out_dir, f"rank{trainer.global_rank}.pt"),
        )


@pytest.mark.slow
def test_ddp_on_two_cpu_processes_trains_and_both_ranks_skip_a_one_rank_overflow(tmp_path):
    run_dir = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(TESTS), env.get("PYTHONPATH")]))
    args = [
        "trainer.accelerator=cpu",
        "trainer.devices=2",
        "trainer.strategy=ddp",
        "trainer.max_steps=8",
        "+fault.rank=1",
        "+fault.inject_inf_at=[2,5]",  # rank 1's gradients only, after the all-reduce
        "scaler.growth_interval=3",
        "+callbacks.rank_state._target_=test_ddp_cli.SaveRankState",
        f"+callbacks.rank_state.out_dir={tmp_path}",
        "trainer.enable_progress_bar=false",
        "plot=false",
        f"hydra.run.dir={run_dir}",
    ]
    # A rank that skipped alone would wait forever in the next all-reduce: the timeout is the hang check.
    proc = subprocess.run(
        [sys.executable, str(ROOT / "train.py"), *args],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]

    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "ok" and summary["global_step"] == 8 and summary["skipped_steps"] == 2
    assert all(torch.isfinite(torch.tensor(v)) for v in summary["final_metrics"].values())
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1)]
    assert [r["injected"] for r in ranks] == [[], [(2, "inf_grad:net.1.weight"), (5, "inf_grad:net.1.weight")]]
    assert ranks[0]["skipped_at"] == ranks[1]["skipped_at"] == [2, 5]
    assert ranks[0]["scale"] == ranks[1]["scale"] == summary["loss_scale"]["end"]
    for name, value in ranks[0]["params"].items():
        assert torch.equal(value, ranks[1]["params"][name]), name
    for a, b in zip(ranks[0]["masters"], ranks[1]["masters"]):
        assert torch.equal(a, b)
    # The checkpoint (written by rank 0) holds exactly that state.
    saved = torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=False)["state_dict"]
    for name, value in ranks[1]["params"].items():
        assert torch.equal(saved[name], value), name


@pytest.mark.slow
def test_ddp_ranks_share_their_run_directory_refuse_another_run_and_stop_together_on_sigterm(tmp_path):
    """The launching process holds the directory's lock for its ranks; a second run is refused; a
    SIGTERM to the launcher stops both ranks after the same step, with one checkpoint and exit 143."""
    import re
    import signal
    import time

    from _cli_procs import QUIET, logged_steps, run, start, throttle, wait_until

    run_dir = tmp_path / "ddp"
    log = tmp_path / "ddp.log"
    ddp = start(
        [
            "trainer=ddp",
            "trainer.accelerator=cpu",
            "trainer.devices=2",
            "trainer.max_steps=60",
            *QUIET,
            *throttle(2, 0.25),
            f"hydra.run.dir={run_dir}",
        ],
        tmp_path,
        log,
    )
    try:
        wait_until(lambda: logged_steps(log), ddp)
        second = run(["recipe=underflow_demo", "trainer.max_steps=3", *QUIET, f"hydra.run.dir={run_dir}"], tmp_path)
        assert second.returncode == 1 and f"hydra.run.dir={run_dir} is in use" in second.stderr, second.stderr[-2000:]
        time.sleep(1.0)
        ddp.send_signal(signal.SIGTERM)
        ddp.wait(timeout=120)
    finally:
        if ddp.poll() is None:
            ddp.kill()
    assert ddp.returncode == 143, log.read_text()[-3000:]
    note = (run_dir / "FAILED").read_text()
    match = re.search(r"Interrupted by SIGTERM at step (\d+)", note)
    assert match, note + log.read_text()[-3000:]
    step = int(match.group(1))
    assert torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=False)["global_step"] == step
    assert f"ckpt_path={run_dir}/checkpoints/last.ckpt hydra.run.dir={run_dir}" in note
    assert "Traceback" not in log.read_text()


@pytest.mark.slow
def test_a_ddp_run_stopped_by_sigterm_mid_epoch_resumes_bit_for_bit(tmp_path):
    """Under DDP each rank reads its share of the epoch; rank 0's checkpoint holds the loader's place in it, the
    same on every rank, so a run stopped mid-epoch and resumed with its FAILED command (across three more
    epochs) ends with an uninterrupted run's weights, FP32 masters and optimizer state."""
    import re
    import signal
    import time

    from _checkpoint_trees import differences
    from _cli_procs import QUIET, env, logged_steps, start, throttle, wait_until

    common = ["trainer=ddp", "trainer.accelerator=cpu", "trainer.devices=2", "trainer.max_steps=40", *QUIET]
    full = start([*common, f"hydra.run.dir={tmp_path / 'full'}"], tmp_path, tmp_path / "full.log")
    assert full.wait(timeout=300) == 0, (tmp_path / "full.log").read_text()[-3000:]
    log = tmp_path / "stopped.log"
    stopped = start([*common, *throttle(2, 0.25), f"hydra.run.dir={tmp_path / 'stopped'}"], tmp_path, log)
    wait_until(lambda: logged_steps(log), stopped)
    time.sleep(2.0)
    stopped.send_signal(signal.SIGTERM)
    assert stopped.wait(timeout=120) == 143, log.read_text()[-3000:]
    note = (tmp_path / "stopped" / "FAILED").read_text()
    stopped_at = int(re.search(r"at step (\d+)", note).group(1))
    command = note.split("resume with ", 1)[1].splitlines()[0]
    resumed = subprocess.run(command, shell=True, env=env(), capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    expected, got = (
        torch.load(tmp_path / d / "checkpoints" / "last.ckpt", weights_only=False) for d in ("full", "stopped")
    )
    for key in ("state_dict", "optimizer_states", "global_step"):
        assert differences(expected[key], got[key]) == [], key
    loader = got["loops"]["fit_loop"]["state_dict"]["combined_loader"][0]  # each rank: 12 batches an epoch
    assert stopped_at % loader["epoch_batches"] and loader["epoch"] == 3 and loader["batches"] == 40 - 3 * 12
