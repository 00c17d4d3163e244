"""The recipes' training loader: each epoch's order a function of (seed, epoch), and a checkpoint's place in it
resumed (Lightning's ``state_dict``/``load_state_dict``), without loading the batches passed over."""

from __future__ import annotations

import pytest
import torch
from lightning.fabric.utilities.types import _Stateful
from torch.utils.data import Dataset

from amp_plugin.recipes._sampling import EpochShuffle, ResumableLoader, train_loader


class Counted(Dataset):
    """Sample ``i`` is ``i``; counts the samples loaded."""

    def __init__(self, n: int) -> None:
        self.n, self.loaded = n, 0

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        self.loaded += 1
        return i


def epoch_order(n: int, batch_size: int, epoch: int) -> list[list[int]]:
    loader = train_loader(Counted(n), batch_size)
    loader.sampler.set_epoch(epoch)
    return [batch.tolist() for batch in loader]


def read(loader, count: int | None = None) -> list[list[int]]:
    batches = []
    for batch in loader:
        batches.append(batch.tolist())
        if len(batches) == count:
            break
    return batches


def test_a_loader_resumed_inside_an_epoch_reads_the_rest_of_its_order_and_loads_only_that():
    full = epoch_order(22, 4, epoch=3)  # six batches, the last of two
    first = train_loader(Counted(22), 4)
    first.sampler.set_epoch(3)
    assert read(first, 2) == full[:2]
    state = first.state_dict()
    assert state == {"epoch": 3, "batches": 2, "epoch_batches": 6, "batch_size": 4, "length": 22}

    data = Counted(22)
    resumed = train_loader(data, 4)
    assert isinstance(resumed, _Stateful)  # Lightning saves and restores it with the fit loop
    resumed.load_state_dict(state)
    resumed.sampler.set_epoch(7)  # what Lightning sets is overridden by the checkpoint's epoch, once
    assert read(resumed) == full[2:]
    assert data.loaded == 22 - 8  # the two batches passed over were not loaded
    resumed.sampler.set_epoch(9)
    assert read(resumed) == epoch_order(22, 4, epoch=4)  # afterwards, each iteration the next epoch


def test_a_loader_never_resumed_reads_the_epoch_lightning_sets():
    loader = train_loader(Counted(22), 4)
    for epoch in (0, 1, 5):
        loader.sampler.set_epoch(epoch)
        assert read(loader) == epoch_order(22, 4, epoch=epoch)


def test_a_checkpoint_at_the_end_of_an_epoch_resumes_with_the_next_epochs_order():
    first = train_loader(Counted(22), 4)
    first.sampler.set_epoch(3)
    read(first)
    resumed = train_loader(Counted(22), 4)
    resumed.load_state_dict(first.state_dict())
    for epoch in (4, 5, 6):
        resumed.sampler.set_epoch(epoch + 1)  # Lightning 2.6's count after resuming an epoch-end checkpoint
        assert read(resumed) == epoch_order(22, 4, epoch=epoch)


def test_another_batch_size_restarts_the_epochs_order_with_a_warning():
    first = train_loader(Counted(22), 4)
    read(first, 3)
    resumed = train_loader(Counted(22), 8)
    resumed.load_state_dict(first.state_dict())
    with pytest.warns(RuntimeWarning, match="22 samples in batches of 4, .* this one 22 in batches of 8, .*restarts"):
        assert read(resumed) == epoch_order(22, 8, epoch=0)


def test_another_share_of_the_epoch_per_process_restarts_the_epochs_order_with_a_warning():
    """A checkpoint of one process resumed under DDP (each rank reads its share: fewer batches an epoch) with
    more batches done than the share holds: it ran past the end of the sampler ("generator raised
    StopIteration" in both ranks). The epoch's order restarts, with the warning of another batch size."""
    first = train_loader(Counted(44), 4)  # 11 batches an epoch
    read(first, 9)
    resumed = train_loader(Counted(44), 4)
    # the checkpoint's process read twice this one's share, and was 15 batches into it
    resumed.load_state_dict({**first.state_dict(), "epoch_batches": 22, "batches": 15})
    with pytest.warns(RuntimeWarning, match="22 batches an epoch in this process, this one .* 11 batches an epoch"):
        assert read(resumed) == epoch_order(44, 4, epoch=0)


def test_a_finished_epoch_resumes_with_the_next_even_in_other_batches():
    first = train_loader(Counted(22), 4)
    read(first)
    resumed = train_loader(Counted(22), 8)
    resumed.load_state_dict(first.state_dict())
    assert read(resumed) == epoch_order(22, 8, epoch=1)  # nothing of epoch 0 left to restart: no warning


def test_a_loader_with_worker_processes_refuses_to_resume():
    data = Counted(8)
    loader = ResumableLoader(data, batch_size=2, sampler=EpochShuffle(data), num_workers=1)
    loader.load_state_dict({"epoch": 0, "batches": 1, "epoch_batches": 4, "batch_size": 2, "length": 8})
    with pytest.raises(ValueError, match="num_workers=1 is not allowed"):
        read(loader)


def test_the_order_of_an_epoch_depends_on_the_seed_and_the_epoch_only():
    torch.manual_seed(123)  # the global RNG plays no part
    a = epoch_order(30, 5, epoch=2)
    torch.manual_seed(9)
    assert epoch_order(30, 5, epoch=2) == a != epoch_order(30, 5, epoch=3)
    assert sorted(i for batch in a for i in batch) == list(range(30))
