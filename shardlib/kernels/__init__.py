"""Triton kernels with torch references: fused AdamW on flat shards, fused vocab-parallel
cross-entropy, LayerNorm/RMSNorm.

Each op is a ``torch.library.custom_op`` in the ``shardlib`` namespace with a fake (meta)
implementation, so it composes with autograd and ``torch.compile``; its file holds the Triton
program and a plain-torch reference. The Triton program runs on CUDA tensors when ``triton``
imports and kernels are enabled; otherwise (CPU, no triton, kernels off) the reference runs.

Where shardlib uses them (CUDA only; the CPU paths are unchanged):

- :class:`~shardlib.ZeroOptimizer` with ``torch.optim.AdamW`` builds a :class:`FusedAdamW`
  (one launch per flat chunk shard; the same ``state`` and ``state_dict`` as torch's);
- :func:`~shardlib.parallel.vocab_parallel_cross_entropy` uses the fused statistics and the
  in-place gradient (:mod:`.cross_entropy`);
- :class:`shardlib.models.GPT`'s LayerNorms call :func:`layer_norm`.

Turn them off with the environment variable ``SHARDLIB_KERNELS=0``, with
``shardlib.kernels.set_enabled(False)``, or for a block with ``with shardlib.kernels.use_kernels(False):``.
Tests run the Triton programs on CPU in Triton's interpreter with ``TRITON_INTERPRET=1`` and
``SHARDLIB_KERNELS_FORCE_TRITON=1`` (see ``tests/test_kernels.py``).
"""

from ._dispatch import HAS_TRITON, enabled, set_enabled, use_kernels, use_triton
from .adamw import FusedAdamW, adamw_, adamw_reference_
from .cross_entropy import fused_ce_applies, fused_vocab_parallel_ce, vocab_ce_grad_, vocab_ce_stats
from .norms import layer_norm, norm_backward, norm_forward, rms_norm

__all__ = [
    "HAS_TRITON", "enabled", "set_enabled", "use_kernels", "use_triton",
    "FusedAdamW", "adamw_", "adamw_reference_",
    "fused_ce_applies", "fused_vocab_parallel_ce", "vocab_ce_grad_", "vocab_ce_stats",
    "layer_norm", "rms_norm", "norm_forward", "norm_backward",
]
