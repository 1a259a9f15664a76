"""The strategies a Plan lowers to: one file per technique."""

from .cross_entropy import vocab_parallel_cross_entropy
from .tensor import ColumnParallelLinear, ParallelEmbedding, RowParallelLinear, VocabParallelEmbedding
from .zero import ZeroRuntime

__all__ = [
    "ZeroRuntime",
    "ColumnParallelLinear",
    "RowParallelLinear",
    "VocabParallelEmbedding",
    "ParallelEmbedding",
    "vocab_parallel_cross_entropy",
]
