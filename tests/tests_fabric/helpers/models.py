"""Small models with the features that make checkpoint loading hard: wrapped blocks, tied weights, buffers."""

from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from transformers import LlamaConfig


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


class UninitializableTable(nn.Module):
    """A module with a non-persistent buffer and no way to initialise it: no `reset_parameters`, not a HF model."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(4))
        self.register_buffer("positions", torch.arange(4.0), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.weight + self.positions


class TableModel(nn.Module):
    """A linear, then an :class:`UninitializableTable` (``table``): what a meta-device init cannot fill on its own."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.table = UninitializableTable()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.table(self.linear(x))


def tiny_llama_config(tie: bool, vocab: int, pad_token_id: int | None = None, hidden: int = 32) -> "LlamaConfig":
    """A Hugging Face Llama config small enough for CPU ranks (transformers must be installed)."""
    import transformers

    return transformers.LlamaConfig(
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=vocab,
        max_position_embeddings=64,
        tie_word_embeddings=tie,
        pad_token_id=pad_token_id,
    )


def make_batch(step: int, vocab: int = 37, batch: int = 4, length: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, vocab, (batch, length + 1), generator=generator)
    return tokens[:, :-1], tokens[:, 1:]
