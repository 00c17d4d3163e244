"""Training-set shuffling that a resumed run repeats exactly.

``DataLoader(shuffle=True)`` draws each epoch's order from the global RNG, which a checkpoint
does not carry: a run resumed at an epoch boundary would see its next epochs in a different
order than the run it continues. :class:`EpochShuffle` makes the order of epoch ``e`` a
function of ``(seed, e)`` alone, the rule of torch's ``DistributedSampler``. Lightning calls
``set_epoch`` at the start of every epoch, also after a resume, and under DDP replaces the
sampler with a ``DistributedSampler`` seeded the same way.

A checkpoint taken inside an epoch (``every_n_train_steps``, a SIGTERM's) also needs where in the
epoch's order the run was: :class:`ResumableLoader` is a ``DataLoader`` with Lightning's
``state_dict``/``load_state_dict`` (the checkpoint's ``loops`` entry holds it), which resumes the
epoch's order after the batches already trained on. Without it Lightning restarts the epoch's
order and stops after the batches left: the first ones are trained on twice, the last ones not at
all. It also resumes a checkpoint written at the end of an epoch with the next epoch's order and
counts on from it, where Lightning 2.6 passes ``set_epoch`` one more than the epoch it runs.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterator, Sized
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, RandomSampler

__all__ = ["EpochShuffle", "ResumableLoader", "train_loader"]


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


class ResumableLoader(DataLoader):
    """A ``DataLoader`` that a checkpoint taken inside an epoch resumes where it was.

    ``state_dict()`` holds the epoch whose order is being read (the sampler's ``epoch``), the
    batches handed out of it so far and in all (this process's: under DDP each rank reads its
    share), and the batch size and dataset length they count in;
    ``load_state_dict()`` makes the next iteration read that epoch's order after those batches (the
    next epoch's from its start when the epoch was finished). The batches passed over are not
    loaded: their indices are drawn from the sampler and dropped, so a dataset that draws random
    numbers draws none for them, as in the run that trained on them. Lightning calls both (the
    fit loop's checkpoint state), and takes the loader as resumable (no warning on a mid-epoch
    resume). In-process loading only (``num_workers=0``): worker processes take indices ahead.

    Once resumed, the loader counts the epochs itself, each iteration the next: Lightning 2.6, resumed
    from a checkpoint written at an epoch's end, passes ``set_epoch`` one more than the epoch it runs,
    for every epoch after. A run never resumed takes Lightning's ``set_epoch`` as it is.
    """

    _resume: dict[str, int] | None = None
    _counting = False  # since a resume: each iteration reads the epoch after the last one's
    _epoch = 0
    _yielded = 0

    def state_dict(self) -> dict[str, int]:
        return {
            "epoch": self._epoch,
            "batches": self._yielded,
            "epoch_batches": len(self),
            "batch_size": int(self.batch_size or 0),
            "length": len(self.dataset),  # type: ignore[arg-type]
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._resume = {key: int(value) for key, value in state.items()}

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        skip = self._resume_here()
        if skip is None:  # no resume now: Lightning's epoch, or the one after ours since a resume
            skip = 0
            if self._counting:
                self._set_epoch(self._epoch + 1)
        self._epoch = int(getattr(self.sampler, "epoch", 0))
        batches = super().__iter__()
        for _ in range(skip):  # the indices of the batches trained on before the checkpoint (torch's
            next(batches._sampler_iter)  # iterator draws each batch's indices from it, then loads them)
        self._yielded = skip
        for batch in batches:
            self._yielded += 1
            yield batch

    def _set_epoch(self, epoch: int) -> None:
        set_epoch = getattr(self.sampler, "set_epoch", None)
        if set_epoch is not None:
            set_epoch(epoch)

    def _resume_here(self) -> int | None:
        """After ``load_state_dict``: set the sampler to the checkpoint's epoch and return the batches
        of it to pass over (once); else ``None``."""
        state, self._resume = self._resume, None
        if state is None:
            return None
        if self.num_workers > 0:
            raise ValueError(
                f"ResumableLoader resumes in-process loading only: num_workers={self.num_workers} is not "
                "allowed (worker processes take indices ahead of the batches handed out)."
            )
        epoch, done = state["epoch"], state["batches"]
        if done >= state["epoch_batches"]:  # the checkpoint's epoch was finished
            epoch, done = epoch + 1, 0
        elif (state["batch_size"], state["length"], state["epoch_batches"]) != (
            self.batch_size,
            len(self.dataset),  # type: ignore[arg-type]
            len(self),
        ):  # another batch size, dataset, or share of it per process (a resume with another process count)
            warnings.warn(
                f"The checkpoint's training loader read {state['length']} samples in batches of "
                f"{state['batch_size']}, {state['epoch_batches']} batches an epoch in this process, this one "
                f"{len(self.dataset)} in batches of {self.batch_size}, {len(self)} batches an epoch: "  # type: ignore[arg-type]
                "the resumed epoch restarts its order.",
                RuntimeWarning,
                stacklevel=2,
            )
            done = 0
        self._set_epoch(epoch)
        self._counting = True
        return done


def train_loader(dataset: Dataset, batch_size: int) -> DataLoader:
    """The recipes' training loader: in-memory data, :class:`EpochShuffle`, no worker processes,
    resumable inside an epoch (:class:`ResumableLoader`)."""
    return ResumableLoader(dataset, batch_size=batch_size, sampler=EpochShuffle(dataset), num_workers=0)
