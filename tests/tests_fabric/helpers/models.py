"""Small models with the features that make checkpoint loading hard: wrapped blocks, tied weights, buffers."""

import torch
from torch import nn


class Block(nn.Module):
    """The unit FSDP wraps: two linears of different shapes and a norm, like a transformer MLP block."""

    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc_in = nn.Linear(width, 3 * width)
        self.fc_out = nn.Linear(3 * width, width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc_out(torch.relu(self.fc_in(self.norm(x))))


class TinyTransformer(nn.Module):
    """An embedding, ``depth`` blocks and a head, optionally tied to the embedding, and a persistent buffer."""

    def __init__(self, vocab: int = 37, width: int = 16, depth: int = 3, tie_weights: bool = False) -> None:
        super().__init__()
        self.embedding = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))
        self.head = nn.Linear(width, vocab, bias=False)
        if tie_weights:
            self.head.weight = self.embedding.weight
        self.register_buffer("scale", torch.empty(width))
        self.register_buffer("cache", torch.empty(4), persistent=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        # FSDP calls this to materialize modules created on the meta device (``empty_init=True``).
        with torch.no_grad():
            self.scale.fill_(0.5)
            self.cache.zero_()

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embedding(tokens) * self.scale
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def make_batch(step: int, vocab: int = 37, batch: int = 4, length: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, vocab, (batch, length + 1), generator=generator)
    return tokens[:, :-1], tokens[:, 1:]
