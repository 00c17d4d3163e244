"""Training-set shuffling that a resumed run repeats exactly.

``DataLoader(shuffle=True)`` draws each epoch's order from the global RNG, which a checkpoint
does not carry: a run resumed at an epoch boundary would see its next epochs in a different
order than the run it continues. :class:`EpochShuffle` makes the order of epoch ``e`` a
function of ``(seed, e)`` alone, the rule of torch's ``DistributedSampler``. Lightning calls
``set_epoch`` at the start of every epoch, also after a resume, and under DDP replaces the
sampler with a ``DistributedSampler`` seeded the same way.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sized

import torch
from torch.utils.data import DataLoader, Dataset, RandomSampler

__all__ = ["EpochShuffle", "train_loader"]


class EpochShuffle(RandomSampler):
    """A random permutation per epoch, seeded with ``seed + epoch``.

    A ``RandomSampler`` subclass, so Lightning treats the loader as shuffled (and swaps in a
    shuffling ``DistributedSampler`` under DDP).

    Args:
        data_source: the dataset (only its length is used).
        seed: base seed; ``None`` takes ``pl.seed_everything``'s seed (``PL_GLOBAL_SEED``, as
            Lightning's own ``DistributedSampler`` does), or 0 when nothing was seeded.
    """

    def __init__(self, data_source: Sized, seed: int | None = None) -> None:
        super().__init__(data_source)
        self.seed = int(os.environ.get("PL_GLOBAL_SEED", 0)) if seed is None else int(seed)
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        """Select the permutation of ``epoch`` (called by Lightning before each epoch)."""
        self.epoch = epoch

    def __iter__(self) -> Iterator[int]:
        generator = torch.Generator().manual_seed(self.seed + self.epoch)
        yield from torch.randperm(len(self.data_source), generator=generator).tolist()


def train_loader(dataset: Dataset, batch_size: int) -> DataLoader:
    """The recipes' training loader: in-memory data, :class:`EpochShuffle`, no worker processes."""
    return DataLoader(dataset, batch_size=batch_size, sampler=EpochShuffle(dataset), num_workers=0)
