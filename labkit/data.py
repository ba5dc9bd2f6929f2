"""Toy datasets that can actually be learned, and loaders that shard them across ranks.

The articles' ``ToyDataset`` draws fresh ``randn`` inputs and random labels on every access (so
nothing can be learned and no two epochs agree), then applies ``transforms.ToTensor()`` to
something that is already a tensor. Here every sample is fixed by the seed, labels come from a
fixed "teacher" network, and image transforms are the tensor-aware ``torchvision.transforms.v2``.
"""

from __future__ import annotations

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from .config import RunConfig


class ToyClassification(Dataset):
    """Gaussian inputs labelled by a random two-layer teacher: learnable, seeded, in memory."""

    def __init__(self, size: int = 4096, in_features: int = 32, classes: int = 10, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(size, in_features, generator=g)
        w1 = torch.randn(in_features, 64, generator=g)
        w2 = torch.randn(64, classes, generator=g)
        self.y = (torch.tanh(self.x @ w1) @ w2).argmax(dim=1)

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i], self.y[i]


class SyntheticImages(Dataset):
    """Small uint8 images whose class is a stripe orientation and frequency, plus noise."""

    def __init__(
        self,
        size: int = 2048,
        classes: int = 10,
        image_size: int = 16,
        channels: int = 3,
        seed: int = 0,
        transform=None,
    ):
        g = torch.Generator().manual_seed(seed)
        self.y = torch.randint(0, classes, (size,), generator=g)
        coords = torch.linspace(0, 1, image_size)
        yy, xx = torch.meshgrid(coords, coords, indexing="ij")
        angle = self.y.float()[:, None, None] * torch.pi / classes
        freq = 2 + (self.y % 3).float()[:, None, None]
        wave = torch.sin(2 * torch.pi * freq * (xx * torch.cos(angle) + yy * torch.sin(angle)))
        noise = 0.3 * torch.randn(size, channels, image_size, image_size, generator=g)
        pixels = (wave[:, None] + noise).clamp(-1, 1)
        self.images = ((pixels + 1) * 127.5).to(torch.uint8)  # like decoded image files
        self.transform = transform if transform is not None else image_transform()

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.transform(self.images[i]), self.y[i]


def image_transform():
    # v2 works on tensors directly: uint8 -> float in [0, 1] -> roughly zero-mean. Imported here:
    # torchvision is slow to import, and only the image models need it.
    from torchvision.transforms import v2

    return v2.Compose([v2.ToDtype(torch.float32, scale=True), v2.Normalize([0.5], [0.5])])


class ToySequences(Dataset):
    """Sequences of Gaussian feature vectors, labelled by a random teacher that weighs each
    position by where it sits (from -1 at the first to +1 at the last): the class depends on
    the whole sequence and on its order, so attention and the position embedding have work."""

    def __init__(
        self,
        size: int = 4096,
        seq_len: int = 16,
        in_features: int = 32,
        classes: int = 10,
        seed: int = 0,
    ):
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(size, seq_len, in_features, generator=g)
        self.w1 = torch.randn(in_features, 64, generator=g) / in_features**0.5
        self.w2 = torch.randn(64, classes, generator=g)
        self.y = self.teacher(self.x)

    def teacher(self, x: torch.Tensor) -> torch.Tensor:
        """The class of each sequence in ``x`` (batch, seq_len, in_features)."""
        where = torch.linspace(-1, 1, x.shape[1])[:, None]  # (seq_len, 1)
        return ((where * torch.tanh(x @ self.w1)).mean(1) @ self.w2).argmax(dim=1)

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i], self.y[i]


def make_dataset(cfg: RunConfig) -> Dataset:
    """The dataset a config asks for (the CNN gets images, the MLPs get vectors, the
    transformer sequences of vectors)."""
    if cfg.model == "cnn":
        return SyntheticImages(cfg.dataset_size, cfg.classes, seed=cfg.seed)
    if cfg.model == "transformer":  # seq_len: a RunConfig field to come
        return ToySequences(cfg.dataset_size, cfg.seq_len, cfg.in_features, cfg.classes, cfg.seed)
    return ToyClassification(cfg.dataset_size, cfg.in_features, cfg.classes, seed=cfg.seed)


def shard_loader(
    dataset: Dataset, batch_size: int, rank: int, world_size: int, seed: int = 0
) -> DataLoader:
    """Rank ``rank``'s loader: a DistributedSampler shard, shuffled by ``seed`` and the epoch.

    With the same seed, the union of every rank's step-k batch is exactly the step-k batch of
    the one-rank loader with ``batch_size * world_size``: that is why DDP can match single-device
    training sample for sample. ``drop_last`` keeps every rank on the same number of steps.
    """
    sampler = DistributedSampler(
        dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=seed, drop_last=True
    )
    if len(sampler) < batch_size:
        raise ValueError(
            f"each rank's shard has {len(sampler)} samples, fewer than one batch of "
            f"{batch_size}: use a larger dataset or a smaller batch"
        )
    return DataLoader(dataset, batch_size=batch_size, sampler=sampler, drop_last=True)


class batches:
    """Endless batches; calls ``set_epoch`` so each epoch reshuffles (the step people forget).

    Knows where it is (``epoch``, ``index``: batches already read from that epoch) and can be
    placed anywhere (``seek``), so a resumed run reads exactly the batches it would have read.
    """

    def __init__(self, loader: DataLoader):
        self.loader, self.epoch, self.index, self._it = loader, 0, 0, None

    def __iter__(self) -> batches:
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self._it is None or self.index >= len(self.loader):
            if self._it is not None:
                self.epoch, self.index = self.epoch + 1, 0
            self._start()
        self.index += 1
        return next(self._it)

    def seek(self, epoch: int, index: int) -> None:
        """Continue from batch ``index`` of ``epoch``. The skipped batches are read and dropped
        (cheap for the in-memory toy datasets; a large dataset wants a sampler with an offset)."""
        self.epoch, self.index = epoch, 0
        self._start()
        for _ in range(index):
            next(self._it)
            self.index += 1

    def _start(self) -> None:
        if isinstance(self.loader.sampler, DistributedSampler):
            self.loader.sampler.set_epoch(self.epoch)
        self._it = iter(self.loader)
