"""Training batches in a resumable order: a fresh permutation per epoch from (seed, epoch) alone, and a
stream that starts anywhere (epoch, batches done) and crosses epoch boundaries without ending.

With a length window (the rows of one optimizer step: micro-batch x accumulation x ranks), the rows of
each step are ordered longest first, so its micro-batches hold rows of like lengths and pad less; a step
still trains on exactly the rows the plain shuffle gives it, in every epoch."""

from __future__ import annotations

from typing import Callable, Iterator, Optional, Sequence

import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from foundation.cli import InputError


class EpochShuffleSampler(Sampler[int]):
    """A fresh permutation each epoch from (seed, epoch) alone, so a resumed run sees the same order.

    With `lengths` and `window` > 1, the rows of each optimizer step are ordered longest first. Steps are
    `window` rows of the stream of epochs, each epoch `kept` rows long (the rest the loader drops): a step's
    rows lie where the plain permutation has them, ordered in two parts where a step spans two epochs, and
    the dropped rows are the plain permutation's."""

    def __init__(self, size: int, seed: int, lengths: Optional[Sequence[int]] = None, window: int = 0,
                 kept: Optional[int] = None):
        if lengths is not None and len(lengths) != size:
            raise ValueError(f"{len(lengths)} lengths for {size} rows")
        self.size, self.seed, self.epoch = size, seed, 0
        self.lengths, self.window = lengths, window if lengths is not None else 0
        self.kept = size if kept is None else kept

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self) -> Iterator[int]:
        g = torch.Generator().manual_seed(self.seed * 100_003 + self.epoch)
        order = torch.randperm(self.size, generator=g).tolist()
        if self.window > 1:
            lengths, first = self.lengths, -self.epoch * self.kept % self.window  # the epoch's first step boundary
            bounds = [0, *range(first, self.kept, self.window), self.kept]
            order = [i for start, end in zip(bounds, bounds[1:])
                     for i in sorted(order[start:end], key=lambda i: -lengths[i])] + order[self.kept :]
        return iter(order)

    def __len__(self) -> int:
        return self.size


def make_loader(dataset: Dataset, collate_fn: Callable, batch_size: int, seed: int, length_window: int = 0,
                ranks: int = 1) -> tuple[DataLoader, EpochShuffleSampler]:
    """Shuffled, drop-last batches of `batch_size`, dealt in turn to `ranks` ranks (Accelerate's sharding, which
    reads whole rounds only); `length_window` > 1, the rows of one optimizer step over all ranks, groups like
    lengths within each step (its examples' `length`)."""
    if len(dataset) < batch_size:
        raise InputError(f"the training set has {len(dataset)} rows, fewer than one batch ({batch_size}); lower the "
                         "batch size or use more data")
    lengths = [example.length for example in dataset] if length_window > 1 else None
    kept = len(dataset) // batch_size // ranks * ranks * batch_size  # the rows an epoch reads
    sampler = EpochShuffleSampler(len(dataset), seed, lengths, length_window, kept)
    # Its own generator: creating a DataLoader iterator draws a seed, and drawing it from the global
    # RNG would shift every later dropout mask whenever a resumed run creates one more iterator.
    loader = DataLoader(dataset, batch_size=batch_size, sampler=sampler, collate_fn=collate_fn, drop_last=True,
                        generator=torch.Generator().manual_seed(seed))
    return loader, sampler


def batch_stream(accelerator, loader, sampler: EpochShuffleSampler, epoch: int, skip: int):
    """Yield (epoch, batches done in this epoch, batch) forever, starting `skip` batches into `epoch`."""
    while True:
        source = accelerator.skip_first_batches(loader, skip) if skip else loader
        # Accelerate's prepared loaders count their own passes and reset the sampler's epoch to that
        # count when iterated; a resumed run's first pass (and the skipping loader, which starts at
        # pass 0) would replay epoch 0's order. Setting the epoch on the loader itself keeps them aligned.
        if hasattr(source, "set_epoch"):
            source.set_epoch(epoch)
        sampler.set_epoch(epoch)
        done = skip
        for batch in source:
            done += 1
            yield epoch, done, batch
        epoch, skip = epoch + 1, 0


def eval_batches(examples: Sequence, collate: Callable, batch_size: int, accelerator, max_batches: int = 0,
                 desc: str = "evaluate", progress: bool = True) -> Iterator[tuple[dict, bool]]:
    """(batch, real) over this rank's share of a held-out set: every example on exactly one rank (the
    first `max_batches` batches' worth per rank, if set), in batches of like lengths so short rows are not
    padded to the longest, on the device, under a progress bar.

    Every rank runs the same number of batches, since under ZeRO-3 or FSDP each forward gathers the
    weights from all ranks: a rank whose share is a row short ends with a repeat of a batch it already
    had, flagged `real=False`, whose outputs the caller drops.
    """
    from tqdm.auto import tqdm

    ranks = accelerator.num_processes
    mine = list(examples[accelerator.process_index :: ranks])
    if max_batches:
        mine = mine[: max_batches * batch_size]
    mine.sort(key=lambda e: e.length, reverse=True)  # longest first: a batch too big fails at once
    largest_share = -(-len(examples) // ranks)
    count = -(-largest_share // batch_size)
    count = min(count, max_batches) if max_batches else count
    for i in tqdm(range(count), desc=desc, leave=False, dynamic_ncols=True,
                  disable=not (progress and accelerator.is_main_process)):
        rows = mine[i * batch_size : (i + 1) * batch_size]
        real = bool(rows)
        batch = collate(rows if real else (mine or list(examples))[:1])
        yield {k: v.to(accelerator.device) for k, v in batch.items()}, real
