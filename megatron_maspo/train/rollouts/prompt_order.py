"""The order prompts are drawn in: a deterministic, epoch-wise shuffle whose state is two integers."""

from __future__ import annotations

import torch


class PromptOrder:
    """Deterministic epoch-wise shuffled order over the dataset; its state is two integers."""

    def __init__(self, n: int, seed: int, epoch: int = 0, cursor: int = 0) -> None:
        if n < 1:
            raise ValueError("the prompt dataset is empty")
        self.n, self.seed, self.epoch, self.cursor = n, seed, epoch, cursor
        self._perm = self._permutation()

    def _permutation(self) -> list[int]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
        return torch.randperm(self.n, generator=g).tolist()

    def take(self, k: int) -> list[int]:
        """The next ``k`` dataset indices, reshuffling at each epoch boundary."""
        out = []
        while len(out) < k:
            if self.cursor >= self.n:
                self.epoch, self.cursor = self.epoch + 1, 0
                self._perm = self._permutation()
            out.append(self._perm[self.cursor])
            self.cursor += 1
        return out

    def state(self) -> dict[str, int]:
        """Resumable position: ``{"epoch", "cursor"}``."""
        return {"epoch": self.epoch, "cursor": self.cursor}
