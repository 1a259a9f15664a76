"""Small models with the awkward features equivalence tests need."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["FrozenConstant", "TiedLM", "gpt_for_tests"]


class TiedLM(nn.Module):
    """A tiny language model with every awkward feature ZeRO must handle.

    Sizes the data axis rarely divides (vocab 37, hidden 10), an input embedding tied to the
    output head, a frozen layer (``requires_grad=False``), and a buffer.

    Args:
        vocab: vocabulary size.
        hidden: model width.
        ffn: width of the inner MLP layer.
        freeze: make the layer ``frozen`` non-trainable.

    ``forward(idx, targets)``: ``idx`` and ``targets`` are ``(batch, seq)`` int64; returns
    ``(logits (batch, seq, vocab), mean cross-entropy loss)``.
    """

    def __init__(self, vocab: int = 37, hidden: int = 10, ffn: int = 13, freeze: bool = True):
        super().__init__()
        self.wte = nn.Embedding(vocab, hidden)
        self.frozen = nn.Linear(hidden, hidden)
        self.frozen.requires_grad_(not freeze)
        self.norm = nn.LayerNorm(hidden)
        self.up = nn.Linear(hidden, ffn)
        self.down = nn.Linear(ffn, hidden)
        self.lm_head = nn.Linear(hidden, vocab, bias=False)
        self.lm_head.weight = self.wte.weight
        self.register_buffer("scale", torch.linspace(0.5, 1.5, hidden))

    def forward(self, idx: torch.Tensor, targets: torch.Tensor):
        x = self.wte(idx)  # (B, T, H)
        x = x + torch.tanh(self.frozen(x)) * self.scale
        x = x + self.down(F.gelu(self.up(self.norm(x))))
        logits = self.lm_head(x)  # (B, T, V)
        loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        return logits, loss


def gpt_for_tests(config):
    """The reference GPT with the key-projection biases frozen.

    A key bias adds ``q . b_k`` to every score of a query, which softmax ignores: its gradient is
    zero in exact arithmetic and rounding noise in practice, and AdamW turns that noise into
    ``lr * g / (|g| + eps)`` updates that differ between any two runs. Freezing it keeps every
    other bias (column-split q/v/fc_in biases, replicated row biases) under test.
    """
    from ..models.gpt import GPT

    model = GPT(config)
    for block in model.blocks:
        if block.attn.k_proj.bias is not None:
            block.attn.k_proj.bias.requires_grad_(False)
    return model


class FrozenConstant(nn.Module):
    """A layer whose output ``(rows, width)`` depends on neither its input nor a trainable
    parameter (a pipeline stage of it alone has nothing to train and sends no gradient on)."""

    def __init__(self, width: int = 8):
        super().__init__()
        self.c = nn.Parameter(torch.randn(width), requires_grad=False)

    def forward(self, x):
        return self.c.expand(x.shape[0], self.c.numel()).contiguous()
