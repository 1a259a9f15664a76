"""shardlib: JAX-style sharding for PyTorch.

Declare a :class:`Mesh` with named axes, put :class:`PartitionSpec` s on parameters, and call
:func:`shard`. This module is the whole public surface; ``__all__`` lists it.
"""

from .errors import CollectiveDeviceError, CollectiveError, CollectiveMismatchError, CollectiveTimeoutError, RankFailureError, ShardingError, WorkerError
from .mesh import (
    AbstractMesh,
    Mesh,
    all_gather,
    all_reduce,
    all_to_all,
    current_mesh,
    init_mesh,
    launch,
    ppermute,
    pvary,
    reduce_scatter,
)
from .lazy import init_parameters
from .mesh.regions import gather_from_region, scatter_to_region
from .optim import GradScaler, ZeroOptimizer, clip_grad_norm_
from .parallel import (
    ColumnParallelLinear,
    ParallelEmbedding,
    RowParallelLinear,
    VocabParallelEmbedding,
    vocab_parallel_cross_entropy,
)
from .parallel.offload import activation_offload
from .plan import ChunkPlan, ParamPlan, Plan, plan
from .pipeline_plan import PipelinePlan
from .shard import (
    PipelineModule,
    ShardedModule,
    full_grads,
    full_state_dict,
    load_full_state_dict,
    model_state_bytes,
    shard,
)
from .spec import NamedSharding, P, PartitionSpec, annotate, distribute, logical_to_mesh


# Public subpackages, imported on first use (``import shardlib`` then ``shardlib.models.GPT``):
# shardlib.checkpoint imports torch.distributed.checkpoint (about half a second).
_SUBPACKAGES = ("checkpoint", "models", "testing", "kernels", "parallel", "mesh", "dryrun")


def __getattr__(name: str):
    if name in _SUBPACKAGES:
        import importlib

        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module 'shardlib' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_SUBPACKAGES))


__all__ = [
    "checkpoint",
    "models",
    "testing",
    "dryrun",
    "ShardingError",
    "WorkerError",
    "CollectiveError",
    "CollectiveMismatchError",
    "CollectiveDeviceError",
    "RankFailureError",
    "CollectiveTimeoutError",
    "AbstractMesh",
    "Mesh",
    "init_mesh",
    "current_mesh",
    "launch",
    "all_reduce",
    "pvary",
    "all_gather",
    "reduce_scatter",
    "all_to_all",
    "ppermute",
    "PartitionSpec",
    "P",
    "NamedSharding",
    "annotate",
    "logical_to_mesh",
    "distribute",
    "plan",
    "Plan",
    "PipelinePlan",
    "ParamPlan",
    "ChunkPlan",
    "shard",
    "ShardedModule",
    "PipelineModule",
    "ZeroOptimizer",
    "clip_grad_norm_",
    "GradScaler",
    "activation_offload",
    "init_parameters",
    "full_state_dict",
    "full_grads",
    "load_full_state_dict",
    "model_state_bytes",
    "gather_from_region",
    "scatter_to_region",
    "ColumnParallelLinear",
    "RowParallelLinear",
    "VocabParallelEmbedding",
    "ParallelEmbedding",
    "vocab_parallel_cross_entropy",
]
