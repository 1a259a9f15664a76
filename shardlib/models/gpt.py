"""A small GPT, readable top to bottom: the reference model for shardlib's examples and tests.

In the spirit of Karpathy's nanoGPT ``model.py`` (https://github.com/karpathy/nanoGPT), after
GPT-2 (Radford et al. 2019, "Language Models are Unsupervised Multitask Learners"): token and
learned position embeddings, ``n_layer`` pre-norm transformer blocks, a final LayerNorm, and a
language-model head tied to the token embedding.

Two choices differ from nanoGPT so that tensor parallelism (Megatron, arXiv 1909.08053) can be
written as plain specs on parameter names, with no change to this file:

- attention has separate ``q_proj``, ``k_proj``, ``v_proj`` (not one fused ``c_attn``), so
  sharding their output dimension (``P("tp", None)``) splits whole heads; the head count is read
  from the local width at run time, so a rank holding ``n_head // tp`` heads just works;
- the MLP is ``fc_in`` (column parallel) then ``fc_out`` (row parallel), and attention ends in
  ``o_proj`` (row parallel). :func:`tp_specs` spells this out.

Sharded with ``vocab_parallel_logits=True`` (the default of :func:`shardlib.models.gpt_preset`),
the LM head keeps its logits split over the vocabulary and the loss is
:func:`~shardlib.parallel.cross_entropy.vocab_parallel_cross_entropy`, as in Megatron: the
``(B, T, V)`` logits never exist on one rank during training.

Shapes in comments: ``B`` batch, ``T`` sequence length, ``C`` width ``n_embd``, ``H`` heads,
``D`` head size ``C // H``, ``V`` vocabulary.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from .. import kernels
from ..parallel.cross_entropy import vocab_parallel_cross_entropy
from ..spec import P, PartitionSpec

__all__ = ["GPTConfig", "GPT", "tp_specs"]


@dataclass(frozen=True)
class GPTConfig:
    """Hyperparameters of :class:`GPT`. The defaults give a ~0.8M-parameter byte-level model.

    Attributes:
        vocab_size: V, number of token ids (256 for bytes).
        block_size: the longest sequence the position embedding covers.
        n_layer: number of transformer blocks.
        n_head: attention heads per block; must divide ``n_embd``.
        n_embd: C, the residual stream width.
        dropout: dropout probability on the embeddings and the residual branches (``nn.Dropout``
            modules, which ``shard`` makes mesh-independent).
        attn_dropout: dropout probability on attention weights, inside
            ``scaled_dot_product_attention`` (torch's RNG: not mesh-independent; default 0).
        bias: whether Linear layers and LayerNorms have a bias.
        tie_embeddings: share one ``(V, C)`` tensor between ``wte`` and ``lm_head`` (GPT-2).
        mlp_ratio: the MLP hidden width is ``mlp_ratio * n_embd``.
    """

    vocab_size: int = 256
    block_size: int = 128
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    dropout: float = 0.0
    attn_dropout: float = 0.0
    bias: bool = True
    tie_embeddings: bool = True
    mlp_ratio: int = 4

    def __post_init__(self):
        if self.n_embd % self.n_head:
            raise ValueError(
                f"GPTConfig: n_embd={self.n_embd} is not divisible by n_head={self.n_head}; "
                "choose n_embd a multiple of n_head"
            )


class LayerNorm(nn.LayerNorm):
    """``nn.LayerNorm`` (same parameters and state dict) that runs :func:`shardlib.kernels.layer_norm`
    (Triton, fp32 statistics) on CUDA when kernels are enabled; elsewhere exactly ``nn.LayerNorm``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Args: x ``(..., C)``. Returns ``(..., C)``."""
        if kernels.use_triton(x):
            return kernels.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)
        return super().forward(x)


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention with separate q/k/v projections.

    Uses ``F.scaled_dot_product_attention(..., is_causal=True)`` (flash/memory-efficient kernels
    where available). The number of heads is inferred from the local width of ``q_proj``'s
    output, so the module runs unchanged when ``q_proj``/``k_proj``/``v_proj`` hold only
    ``n_head // tp`` heads (column parallel) and ``o_proj`` the matching input columns.
    """

    def __init__(self, config: GPTConfig):
        super().__init__()
        C = config.n_embd
        self.head_size = C // config.n_head
        self.q_proj = nn.Linear(C, C, bias=config.bias)
        self.k_proj = nn.Linear(C, C, bias=config.bias)
        self.v_proj = nn.Linear(C, C, bias=config.bias)
        self.o_proj = nn.Linear(C, C, bias=config.bias)
        self.dropout = config.attn_dropout
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Args: x ``(B, T, C)``. Returns ``(B, T, C)``."""
        B, T, _ = x.shape
        # (B, T, H*D) -> (B, H, T, D); H is the number of heads on this rank
        q = self.q_proj(x).view(B, T, -1, self.head_size).transpose(1, 2)
        k = self.k_proj(x).view(B, T, -1, self.head_size).transpose(1, 2)
        v = self.v_proj(x).view(B, T, -1, self.head_size).transpose(1, 2)
        p = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)  # (B, H, T, D)
        y = y.transpose(1, 2).contiguous().view(B, T, -1)  # (B, T, H*D), heads side by side
        return self.resid_dropout(self.o_proj(y))  # (B, T, C)


class MLP(nn.Module):
    """Position-wise feed-forward: ``fc_in`` (C -> mlp_ratio*C), GELU, ``fc_out`` (back to C)."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        hidden = config.mlp_ratio * config.n_embd
        self.fc_in = nn.Linear(config.n_embd, hidden, bias=config.bias)
        self.gelu = nn.GELU()
        self.fc_out = nn.Linear(hidden, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Args: x ``(B, T, C)``. Returns ``(B, T, C)``."""
        return self.dropout(self.fc_out(self.gelu(self.fc_in(x))))  # (B, T, 4C) inside


class Block(nn.Module):
    """Pre-norm transformer block: ``x + attn(ln_1(x))``, then ``x + mlp(ln_2(x))``."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.ln_1 = LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Args: x ``(B, T, C)``. Returns ``(B, T, C)``."""
        x = x + self.attn(self.ln_1(x))
        x = x + self.mlp(self.ln_2(x))
        return x


class GPT(nn.Module):
    """A GPT-2 style decoder-only language model.

    Parameters are initialized as in GPT-2 / nanoGPT: every Linear and Embedding weight from
    ``N(0, 0.02)``, biases zero, and the projections that write into the residual stream
    (``o_proj``, ``fc_out``) from ``N(0, 0.02 / sqrt(2 * n_layer))``. Initialization draws from
    the torch global RNG in a fixed order, so ``torch.manual_seed(s); GPT(cfg)`` is reproducible.

    Args:
        config: the hyperparameters.

    Example:
        >>> torch.manual_seed(0)  # doctest: +ELLIPSIS
        <torch._C.Generator object at ...>
        >>> model = GPT(GPTConfig(n_layer=2, n_embd=32, n_head=2, block_size=16))
        >>> idx = torch.randint(0, 256, (3, 16))  # (B, T)
        >>> logits, loss = model(idx, targets=idx)
        >>> tuple(logits.shape), loss.shape
        ((3, 16, 256), torch.Size([]))
    """

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)  # token embedding (V, C)
        self.wpe = nn.Embedding(config.block_size, config.n_embd)  # position embedding
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = LayerNorm(config.n_embd, bias=config.bias)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        if config.tie_embeddings:
            # weight tying (Press & Wolf 2017; GPT-2): one (V, C) tensor, two uses
            self.lm_head.weight = self.wte.weight
        self.apply(self._init_weights)
        residual_std = 0.02 / math.sqrt(2 * config.n_layer)
        for block in self.blocks:
            nn.init.normal_(block.attn.o_proj.weight, mean=0.0, std=residual_std)
            nn.init.normal_(block.mlp.fc_out.weight, mean=0.0, std=residual_std)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        # nn.LayerNorm keeps its default init: weight 1, bias 0

    def shardlib_init_rules(self) -> dict[str, tuple]:
        """The initialization above as mesh-independent rules (glob -> rule, first match wins),
        for a model built on the meta device (:mod:`shardlib.lazy`): ``shard(meta_gpt, ...)``
        and ``shardlib.lazy.init_parameters(gpt, seed)`` give equal tensors for any mesh.
        The distributions are GPT-2's; the values are drawn by counter, not torch's RNG."""
        residual_std = 0.02 / math.sqrt(2 * self.config.n_layer)
        return {
            "blocks.*.attn.o_proj.weight": ("normal", residual_std),
            "blocks.*.mlp.fc_out.weight": ("normal", residual_std),
            "*ln_*.weight": ("ones",),
            "*.bias": ("zeros",),
            "*.weight": ("normal", 0.02),
        }

    def num_params(self, non_embedding: bool = False) -> int:
        """Number of parameter elements, each shared tensor counted once.

        Args:
            non_embedding: leave out the position embedding (and the token embedding unless it
                is tied to ``lm_head``, where it also serves as the output layer), as nanoGPT
                reports.

        Returns:
            The count.
        """
        n = sum(p.numel() for p in self.parameters())  # parameters() yields a tied tensor once
        if non_embedding:
            n -= self.wpe.weight.numel()
            if not self.config.tie_embeddings:
                n -= self.wte.weight.numel()
        return n

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Next-token logits, and the loss when targets are given.

        Args:
            idx: token ids, int64 ``(B, T)`` with ``T <= block_size``.
            targets: the next token at each position, int64 ``(B, T)``, or None.

        Returns:
            ``(logits, loss)``: logits float ``(B, T, V)``; loss the mean cross-entropy over all
            ``B * T`` positions (a 0-dim tensor, nats per token), or None without targets.
            Sharded with ``vocab_parallel_logits=True``: with targets, the loss is computed on
            vocabulary-parallel logits and ``logits`` is this rank's slice ``(B, T, V // tp)``
            (torch.chunk layout; the full ones are never formed); without targets the logits
            are all-gathered, ``(B, T, V)`` on every rank (for evaluation and :meth:`generate`).

        Raises:
            ValueError: ``T`` is longer than ``block_size``.
        """
        B, T = idx.shape
        self._check_length(T)
        pos = torch.arange(T, device=idx.device)  # (T,)
        x = self.drop(self.wte(idx) + self.wpe(pos))  # (B, T, C) + (T, C) -> (B, T, C)
        for block in self.blocks:
            x = block(x)  # (B, T, C)
        x = self.ln_f(x)
        logits = self.lm_head(x)  # (B, T, V); sharded with vocab_parallel_logits: this rank's (B, T, V // tp)
        head = self.lm_head
        split = getattr(head, "parallel_output", False)  # a ColumnParallelLinear that keeps its slice
        if targets is None:
            return (head.gather(logits) if split else logits), None  # whoever asks for logits gets them all
        if split:  # Megatron's parallel_output: max, sum of exponentials and target logit all-reduced, no gather
            loss = vocab_parallel_cross_entropy(logits, targets, axis=head.axis, vocab_size=head.out_features, mesh=head.mesh)
        else:
            loss = F.cross_entropy(logits.reshape(B * T, -1), targets.reshape(B * T))
        return logits, loss

    def _check_length(self, T: int) -> None:
        if T > self.config.block_size:
            raise ValueError(
                f"GPT.forward: sequence length {T} exceeds block_size={self.config.block_size}; "
                "feed shorter windows or build the model with a larger block_size"
            )

    def pipeline_layers(self) -> list:
        """The forward pass as an ordered list of layers, for pipeline parallelism.

        Returns ``[(name, {path: module}, fn)]``; ``fn(get, x)`` runs the layer, fetching each
        module with ``get(path)`` (a pipeline stage holds the modules at their original paths, so
        parameter names do not change, and may have swapped them for parallel versions). The
        first layer takes token ids ``(B, T)``; the last returns logits ``(B, T, V)``.
        """
        def embed(get, idx):
            self._check_length(idx.shape[1])  # the first stage's rank raises; its peers' verdict names it
            pos = torch.arange(idx.shape[1], device=idx.device)
            return get("drop")(get("wte")(idx) + get("wpe")(pos))  # (B, T, C)

        def head(get, x):
            return get("lm_head")(get("ln_f")(x))  # (B, T, V)

        def block(i):
            return lambda get, x: get(f"blocks.{i}")(x)

        layers = [("embed", {"wte": self.wte, "wpe": self.wpe, "drop": self.drop}, embed)]
        layers += [(f"blocks.{i}", {f"blocks.{i}": b}, block(i)) for i, b in enumerate(self.blocks)]
        layers.append(("head", {"ln_f": self.ln_f, "lm_head": self.lm_head}, head))
        return layers

    @torch.no_grad()
    def generate(self, idx: torch.Tensor, max_new_tokens: int, temperature: float = 1.0,
                 generator: torch.Generator | None = None) -> torch.Tensor:
        """Sample ``max_new_tokens`` tokens after ``idx``, feeding the model its own output.

        Args:
            idx: prompt token ids, int64 ``(B, T0)``.
            max_new_tokens: how many tokens to append.
            temperature: divides the logits before sampling (lower is greedier).
            generator: the RNG for sampling (default: the global one).

        Returns:
            int64 ``(B, T0 + max_new_tokens)``.
        """
        for _ in range(max_new_tokens):
            context = idx[:, -self.config.block_size:]  # (B, <= block_size)
            logits, _ = self(context)
            probs = F.softmax(logits[:, -1, :] / temperature, dim=-1)  # (B, V)
            nxt = torch.multinomial(probs, num_samples=1, generator=generator)  # (B, 1)
            idx = torch.cat([idx, nxt], dim=1)
        return idx


def tp_specs(axis: str = "tp") -> dict[str, PartitionSpec]:
    """Megatron tensor-parallel specs for :class:`GPT` (arXiv 1909.08053, section 3).

    q/k/v and ``fc_in`` are column parallel (output features, i.e. whole heads, split over
    ``axis``); ``o_proj`` and ``fc_out`` are row parallel (input features split), so each block
    needs one all-reduce after attention and one after the MLP. Embeddings, norms and the
    row-parallel biases stay replicated; a column layer's bias follows its weight (no pattern needed,
    so the specs also fit a model built with ``bias=False``). ``n_head`` must be divisible by the axis size.

    Args:
        axis: the mesh axis to split over.

    Returns:
        Glob patterns over ``GPT.named_parameters()`` names mapped to specs, for ``shard``.
    """
    return {
        "blocks.*.attn.[qkv]_proj.weight": P(axis, None),
        "blocks.*.attn.o_proj.weight": P(None, axis),
        "blocks.*.mlp.fc_in.weight": P(axis, None),
        "blocks.*.mlp.fc_out.weight": P(None, axis),
    }
