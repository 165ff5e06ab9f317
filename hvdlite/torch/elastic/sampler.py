"""`ElasticSampler`: a distributed sampler that survives a change of world size mid-epoch."""
from __future__ import annotations

import math
import random
from typing import Any, Iterator, Sized

import torch.utils.data

from ...common import basics as _basics


class ElasticSampler(torch.utils.data.Sampler):
    """Like `DistributedSampler`, but it remembers how many samples of the epoch the job has
    processed, and after a reset it spreads only the remaining ones over the new set of ranks.

    Call `record_batch(batch_idx, batch_size)` after each batch (before `state.commit()`) and
    `set_epoch(epoch)` at the start of each epoch; put the sampler in the `TorchState` so that
    it is committed, restored and synced with the model:

        sampler = hvd.elastic.ElasticSampler(dataset)
        loader = torch.utils.data.DataLoader(dataset, batch_size=32, sampler=sampler)
        state = hvd.elastic.TorchState(model, optimizer, sampler=sampler, epoch=0)

    With `shuffle` the permutation depends only on `seed + epoch`, so every rank (and a worker
    that joins later) sees the same order.
    """

    def __init__(self, dataset: Sized, shuffle: bool = True, seed: int = 0) -> None:
        self.dataset = dataset
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0
        self.processed_num = 0        # samples of this epoch done by the whole job
        self.num_replicas = 1
        self.rank = 0
        self.remaining_indices: list[int] = []
        self.num_samples = 0
        self.total_size = 0
        self.reset()

    def set_epoch(self, epoch: int) -> None:
        """Start `epoch` from its first sample."""
        self.epoch = epoch
        self.processed_num = 0
        self.reset()

    def record_batch(self, batch_idx: int, batch_size: int) -> None:
        """Mark one batch of `batch_size` samples per rank as processed by every rank."""
        self.record_indices(batch_size * self.num_replicas)

    def record_indices(self, count: int) -> None:
        """Mark `count` more samples (over all ranks) as processed."""
        self.processed_num = min(self.processed_num + int(count), len(self.dataset))

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "processed_num": self.processed_num}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.epoch = state_dict["epoch"]
        self.processed_num = state_dict["processed_num"]
        self.reset()

    def reset(self) -> None:
        """Re-partition what remains of the epoch over the current ranks."""
        if _basics.is_initialized():
            self.num_replicas, self.rank = _basics.size(), _basics.rank()
        else:
            self.num_replicas, self.rank = 1, 0
        indices = list(range(len(self.dataset)))
        if self.shuffle:
            random.Random(self.seed + self.epoch).shuffle(indices)
        self.remaining_indices = indices[self.processed_num:]
        self.num_samples = int(math.ceil(len(self.remaining_indices) / self.num_replicas))
        self.total_size = self.num_samples * self.num_replicas

    def __iter__(self) -> Iterator[int]:
        indices = list(self.remaining_indices)
        # Pad by repeating from the start so that every rank gets the same number of batches.
        if indices:
            while len(indices) < self.total_size:
                indices += indices[:self.total_size - len(indices)]
        return iter(indices[self.rank:self.total_size:self.num_replicas])

    def __len__(self) -> int:
        return self.num_samples
