"""Triton kernels with torch references: fused AdamW on flat shards, fused vocab-parallel
cross-entropy, LayerNorm/RMSNorm.

Each op is a ``torch.library.custom_op`` in the ``shardlib`` namespace with a fake (meta)
implementation, so it composes with autograd and ``torch.compile``; its file holds the launch
code and a plain-torch reference, and ``_programs.py`` the Triton programs (imported, with
``triton``, on the first launch). The Triton program runs on CUDA tensors when ``triton``
imports and kernels are enabled; otherwise (CPU, no triton, kernels off) the reference runs.

Where shardlib uses them (CUDA; on CPU only the optimizer, whose reference runs in cache-sized
blocks):

- :class:`~shardlib.ZeroOptimizer` with ``torch.optim.AdamW`` builds a :class:`FusedAdamW`
  (one launch per flat chunk shard on CUDA, torch's update block by block on CPU; the same
  ``state`` and ``state_dict`` as torch's);
- :func:`~shardlib.parallel.vocab_parallel_cross_entropy` uses the fused statistics and the
  in-place gradient (:mod:`.cross_entropy`);
- :class:`shardlib.models.GPT`'s LayerNorms call :func:`layer_norm`.

Turn them off with the environment variable ``SHARDLIB_KERNELS=0``, with
``shardlib.kernels.set_enabled(False)``, or for a block with ``with shardlib.kernels.use_kernels(False):``.
Tests run the Triton programs on CPU in Triton's interpreter with ``TRITON_INTERPRET=1`` and
``SHARDLIB_KERNELS_FORCE_TRITON=1`` (see ``tests/test_kernels.py``).

The op modules are imported on first use of one of their names, and ``triton`` only when a
Triton program is about to run, so ``import shardlib`` (which uses :class:`FusedAdamW`) and a
CPU run never import triton.
"""

import importlib

from ._dispatch import enabled, set_enabled, triton_available, use_kernels, use_triton

_LAZY = {
    "FusedAdamW": "adamw", "adamw_": "adamw", "adamw_reference_": "adamw", "CPU_BLOCK": "adamw",
    "fused_ce_applies": "cross_entropy",
    "vocab_ce_grad_": "cross_entropy", "vocab_ce_stats": "cross_entropy",
    "layer_norm": "norms", "rms_norm": "norms", "norm_forward": "norms", "norm_backward": "norms",
}

__all__ = ["HAS_TRITON", "enabled", "set_enabled", "triton_available", "use_kernels", "use_triton", *_LAZY]


def __getattr__(name: str):
    if name == "HAS_TRITON":
        return triton_available()
    if name in _LAZY:
        value = getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(__all__))
