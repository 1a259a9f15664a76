"""LLaMA- and PaLM-style decoder-only models, readable top to bottom, for the training tool.

LLaMA (Touvron et al. 2023, arXiv 2302.13971; grouped-query attention from LLaMA 2, arXiv
2307.09288, and Ainslie et al. 2023, arXiv 2305.13245): pre-norm blocks with RMSNorm, rotary
position embeddings (Su et al. 2021, arXiv 2104.09864) on queries and keys, grouped-query
attention (``n_kv_head`` key/value heads shared by ``n_head / n_kv_head`` query heads each), a
SwiGLU MLP (Shazeer 2020, arXiv 2002.05202), no biases, an untied output layer.

PaLM (Chowdhery et al. 2022, arXiv 2204.02311, section 2): the same parts with a *parallel*
block, ``x + attn(norm(x)) + mlp(norm(x))`` (one norm, both branches read it), multi-query
attention (one key/value head), LayerNorm without bias, and the input embedding shared with
the output layer.

Tensor parallelism (Megatron, arXiv 1909.08053) is plain specs on parameter names
(:func:`llama_tp_specs`): q/k/v, gate and up column parallel, o and down row parallel, the
embedding and output layer vocabulary parallel. The head counts are read from the local widths
at run time, so a rank holding ``n_head / tp`` query and ``n_kv_head / tp`` key/value heads runs
unchanged; PaLM's single key/value head is not split (``n_kv_head`` must be divisible by the
axis size: multi-query attention is refused on ``tp > 1``).

Shapes in comments: ``B`` batch, ``T`` sequence, ``C`` width, ``H`` query heads, ``G``
key/value heads, ``D`` head size ``C / H``, ``F`` MLP hidden width, ``V`` vocabulary.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..parallel.cross_entropy import vocab_parallel_cross_entropy
from ..spec import P, PartitionSpec

__all__ = ["LlamaConfig", "Llama", "PaLMConfig", "PaLM", "llama_tp_specs", "rotary"]


@dataclass(frozen=True)
class LlamaConfig:
    """Hyperparameters of :class:`Llama`. The defaults give a ~0.9M-parameter byte-level model.

    Attributes:
        vocab_size: V.
        block_size: the longest sequence (rotary positions are computed, not learned; this bounds T).
        n_layer: blocks.
        n_head: H, query heads; divides ``n_embd``.
        n_kv_head: G, key/value heads; divides ``n_head`` (G = H: multi-head, G = 1: multi-query).
        n_embd: C.
        ffn_hidden: F, the SwiGLU hidden width; 0: LLaMA's rule, ``8C/3`` rounded up to ``multiple_of``.
        multiple_of: the rounding of the default F.
        norm_eps: the norms' epsilon.
        rope_theta: the rotary base.
        tie_embeddings: share the ``(V, C)`` embedding with the output layer.
        parallel_block: PaLM's ``x + attn(norm(x)) + mlp(norm(x))`` instead of two residual steps.
    """

    vocab_size: int = 256
    block_size: int = 128
    n_layer: int = 4
    n_head: int = 4
    n_kv_head: int = 2
    n_embd: int = 128
    ffn_hidden: int = 0
    multiple_of: int = 32
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    tie_embeddings: bool = False
    parallel_block: bool = False

    @property
    def hidden(self) -> int:
        """F, the SwiGLU hidden width."""
        if self.ffn_hidden:
            return self.ffn_hidden
        f = int(8 * self.n_embd / 3)
        return self.multiple_of * math.ceil(f / self.multiple_of)


def PaLMConfig(**kwargs) -> LlamaConfig:  # noqa: N802 - a config constructor, named as the others
    """PaLM's choices over :class:`LlamaConfig`: a parallel block, one key/value head
    (multi-query), the embedding tied to the output layer; any of them can be overridden."""
    return LlamaConfig(**{"n_kv_head": 1, "tie_embeddings": True, "parallel_block": True, **kwargs})


def rotary(x: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotary position embedding of ``x`` ``(B, heads, T, D)`` (D even) at positions ``0..T-1``:
    each pair ``(x[2i], x[2i+1])`` rotated by ``t * theta^(-2i/D)`` (Su et al., RoFormer), in fp32."""
    B, H, T, D = x.shape
    inv = theta ** (-torch.arange(0, D, 2, device=x.device, dtype=torch.float32) / D)  # (D/2,)
    angle = torch.arange(T, device=x.device, dtype=torch.float32)[:, None] * inv[None, :]  # (T, D/2)
    cos, sin = angle.cos(), angle.sin()
    xf = x.float().reshape(B, H, T, D // 2, 2)
    a, b = xf[..., 0], xf[..., 1]
    out = torch.stack((a * cos - b * sin, a * sin + b * cos), dim=-1)  # (B, H, T, D/2, 2)
    return out.reshape(B, H, T, D).to(x.dtype)


class Attention(nn.Module):
    """Causal grouped-query attention with rotary positions; no biases."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        C, H, G = config.n_embd, config.n_head, config.n_kv_head
        self.head_size = C // H
        self.theta = config.rope_theta
        self.q_proj = nn.Linear(C, H * self.head_size, bias=False)
        self.k_proj = nn.Linear(C, G * self.head_size, bias=False)
        self.v_proj = nn.Linear(C, G * self.head_size, bias=False)
        self.o_proj = nn.Linear(H * self.head_size, C, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Args: x ``(B, T, C)``. Returns ``(B, T, C)``."""
        B, T, _ = x.shape
        D = self.head_size
        q = self.q_proj(x).view(B, T, -1, D).transpose(1, 2)  # (B, H, T, D); H local under tp
        k = self.k_proj(x).view(B, T, -1, D).transpose(1, 2)  # (B, G, T, D)
        v = self.v_proj(x).view(B, T, -1, D).transpose(1, 2)
        q, k = rotary(q, self.theta), rotary(k, self.theta)
        group = q.shape[1] // k.shape[1]  # query heads per key/value head (the same on every tp rank)
        if group > 1:
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)  # (B, H, T, D)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, H, T, D)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, -1))


class SwiGLU(nn.Module):
    """``down(silu(gate(x)) * up(x))``: C -> F -> C, no biases."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.gate_proj = nn.Linear(config.n_embd, config.hidden, bias=False)
        self.up_proj = nn.Linear(config.n_embd, config.hidden, bias=False)
        self.down_proj = nn.Linear(config.hidden, config.n_embd, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Args: x ``(B, T, C)``. Returns ``(B, T, C)``; ``(B, T, F)`` inside."""
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def _norm(config: LlamaConfig) -> nn.Module:
    if config.parallel_block:  # PaLM: LayerNorm without bias
        return nn.LayerNorm(config.n_embd, eps=config.norm_eps, bias=False)
    return nn.RMSNorm(config.n_embd, eps=config.norm_eps)


class Block(nn.Module):
    """LLaMA: ``h = x + attn(attn_norm(x)); h + mlp(mlp_norm(h))``. PaLM (``parallel_block``):
    ``x + attn(attn_norm(x)) + mlp(attn_norm(x))`` (one norm)."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.parallel = config.parallel_block
        self.attn_norm = _norm(config)
        self.attn = Attention(config)
        self.mlp_norm = None if self.parallel else _norm(config)
        self.mlp = SwiGLU(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Args: x ``(B, T, C)``. Returns ``(B, T, C)``."""
        if self.parallel:
            h = self.attn_norm(x)
            return x + self.attn(h) + self.mlp(h)
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class Llama(nn.Module):
    """A LLaMA-style (or, with :func:`PaLMConfig`, PaLM-style) decoder-only language model.

    Initialization: every Linear and the embedding from ``N(0, 0.02)``, the projections into the
    residual stream (``o_proj``, ``down_proj``) from ``N(0, 0.02 / sqrt(2 n_layer))``, norms one;
    drawn from torch's global RNG in a fixed order (``torch.manual_seed(s); Llama(cfg)`` is
    reproducible). :meth:`shardlib_init_rules` gives the same distributions for meta-device init.

    Args:
        config: the hyperparameters.

    Raises:
        ValueError: ``n_embd`` not divisible by ``n_head``, ``n_head`` by ``n_kv_head``, or an odd head size.
    """

    def __init__(self, config: LlamaConfig):
        super().__init__()
        if config.n_embd % config.n_head or config.n_head % config.n_kv_head or (config.n_embd // config.n_head) % 2:
            raise ValueError(f"Llama: n_embd ({config.n_embd}) must be divisible by n_head ({config.n_head}), n_head "
                             f"by n_kv_head ({config.n_kv_head}), and the head size must be even (rotary pairs)")
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)  # (V, C)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.norm = _norm(config)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.lm_head.weight = self.wte.weight
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)) and not (module is self.lm_head and config.tie_embeddings):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)
        residual_std = 0.02 / math.sqrt(2 * config.n_layer)
        for block in self.blocks:
            nn.init.normal_(block.attn.o_proj.weight, mean=0.0, std=residual_std)
            nn.init.normal_(block.mlp.down_proj.weight, mean=0.0, std=residual_std)

    def shardlib_init_rules(self) -> dict[str, tuple]:
        """The initialization as mesh-independent rules (glob -> rule), for meta-device models."""
        residual_std = 0.02 / math.sqrt(2 * self.config.n_layer)
        return {
            "blocks.*.attn.o_proj.weight": ("normal", residual_std),
            "blocks.*.mlp.down_proj.weight": ("normal", residual_std),
            "*norm.weight": ("ones",),
            "*.weight": ("normal", 0.02),
        }

    def num_params(self, non_embedding: bool = False) -> int:
        """Parameter elements, a tied tensor once; ``non_embedding`` leaves out the input
        embedding unless it is tied (then it is the output layer's matmul)."""
        n = sum(p.numel() for p in self.parameters())
        if non_embedding and not self.config.tie_embeddings:
            n -= self.wte.weight.numel()
        return n

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        """Next-token logits, and the loss when targets are given (as :meth:`shardlib.models.GPT.forward`).

        Args:
            idx: token ids, int64 ``(B, T)`` with ``T <= block_size``.
            targets: int64 ``(B, T)`` or None.

        Returns:
            ``(logits, loss)``: logits ``(B, T, V)`` (this rank's ``(B, T, V / tp)`` under
            ``vocab_parallel_logits`` with targets), loss the mean cross-entropy (nats per token) or None.

        Raises:
            ValueError: ``T`` above ``block_size``.
        """
        B, T = idx.shape
        if T > self.config.block_size:
            raise ValueError(f"Llama.forward: sequence length {T} exceeds block_size={self.config.block_size}")
        x = self.wte(idx)  # (B, T, C)
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.norm(x))  # (B, T, V) or this rank's (B, T, V / tp)
        head = self.lm_head
        split = getattr(head, "parallel_output", False)
        if targets is None:
            return (head.gather(logits) if split else logits), None
        if split:
            loss = vocab_parallel_cross_entropy(logits, targets, axis=head.axis, vocab_size=head.out_features,
                                                mesh=head.mesh)
        else:
            # at least fp32 (half-precision logits), as vocab_parallel_cross_entropy computes: a float64
            # model's loss stays float64 on one process as on the vocabulary-parallel path
            flat = logits.reshape(B * T, -1)
            loss = F.cross_entropy(flat.to(torch.promote_types(flat.dtype, torch.float32)), targets.reshape(B * T))
        return logits, loss

    def pipeline_layers(self) -> list:
        """The forward as ordered layers for pipeline parallelism, as :meth:`shardlib.models.GPT.pipeline_layers`:
        the embedding, each block, then the final norm and output layer (logits ``(B, T, V)``)."""
        def embed(get, idx):
            return get("wte")(idx)

        def head(get, x):
            return get("lm_head")(get("norm")(x))

        def block(i):
            return lambda get, x: get(f"blocks.{i}")(x)

        layers = [("embed", {"wte": self.wte}, embed)]
        layers += [(f"blocks.{i}", {f"blocks.{i}": b}, block(i)) for i, b in enumerate(self.blocks)]
        layers.append(("head", {"norm": self.norm, "lm_head": self.lm_head}, head))
        return layers


def PaLM(config: LlamaConfig) -> Llama:  # noqa: N802 - a model constructor
    """A PaLM-style model: :class:`Llama` with ``config.parallel_block`` (use :func:`PaLMConfig`).

    Raises:
        ValueError: ``config.parallel_block`` is False (that is LLaMA's block).
    """
    if not config.parallel_block:
        raise ValueError("PaLM: the config has parallel_block=False; build it with PaLMConfig(...)")
    return Llama(config)


def llama_tp_specs(axis: str = "tp") -> dict[str, PartitionSpec]:
    """Megatron tensor-parallel specs for :class:`Llama` and PaLM (arXiv 1909.08053, section 3).

    q/k/v, gate and up column parallel (whole heads, whole hidden units per rank), o and down row
    parallel: one all-reduce after each of attention and the MLP (PaLM's parallel block: both
    row-parallel outputs are summed into one residual). The embedding is vocabulary parallel.
    ``n_head`` and ``n_kv_head`` must be divisible by the axis size.
    """
    return {
        "wte.weight": P(axis, None),
        "blocks.*.attn.[qkv]_proj.weight": P(axis, None),
        "blocks.*.attn.o_proj.weight": P(None, axis),
        "blocks.*.mlp.gate_proj.weight": P(axis, None),
        "blocks.*.mlp.up_proj.weight": P(axis, None),
        "blocks.*.mlp.down_proj.weight": P(None, axis),
        "lm_head.weight": P(axis, None),
    }
