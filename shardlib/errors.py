"""The error family of shardlib.

Every user-facing error is a :class:`ShardingError` (a ``ValueError``) raised at plan time, on
every rank, before any communication. Messages follow JAX's ``_spec_divisibility_error``: what
was given (parameter name, shape, spec), the mesh, the rule broken, and a fix.
"""

from __future__ import annotations

__all__ = [
    "ShardingError",
    "NotElementwiseError",
    "ShardedAwayError",
    "WorkerError",
    "CollectiveError",
    "CollectiveMismatchError",
    "RankFailureError",
    "CollectiveTimeoutError",
    "CollectiveDeviceError",
]


class ShardingError(ValueError):
    """A mesh, spec, plan option or input that shardlib cannot lower.

    Raised identically on every rank before the first collective, so no rank is left waiting.
    """


class NotElementwiseError(ShardingError, TypeError):
    """An optimizer class :class:`~shardlib.ZeroOptimizer` cannot shard: its update of a part of
    a tensor is not that part of its update of the whole tensor (it reads a whole-tensor
    statistic: a norm, rows and columns, the shape). Raised in ``ZeroOptimizer(...)`` on every
    rank, before the first step; also a ``TypeError`` (the wrong kind of optimizer class)."""


class ShardedAwayError(RuntimeError):
    """A parameter whose storage ZeRO-3 freed was read or written outside the sharded module.

    Under ZeRO-3 (arXiv 1910.02054) a chunk's full buffer exists only while the forward or
    backward of the module :func:`shardlib.shard` returned uses it; in between, each rank keeps
    its shard and the original module's parameters keep only their metadata (shape, dtype,
    device, ``requires_grad``, ``grad``). Any torch operation on one of them (reading, printing,
    ``detach()``, ``state_dict()``, ``copy_``, ``torch.save``) raises this error, naming the
    parameter, instead of reading freed memory. Not a plan-time error: it is raised where the
    tensor is touched, on the rank that touched it.
    """


class WorkerError(RuntimeError):
    """A worker process of :func:`shardlib.launch` (or the test pool) failed.

    Attributes:
        rank: the global rank that failed first.
        exc_type: the name of the exception class raised on that rank.
        remote_traceback: the formatted traceback from that rank.
        errors: ``{rank: (exc_type, message)}`` for every rank that reported an error before the
            workers were stopped (all ranks, for an error raised identically at plan time).
    """

    def __init__(self, rank: int, exc_type: str, message: str, remote_traceback: str = "", errors=None):
        self.rank = rank
        self.exc_type = exc_type
        self.message = message
        self.remote_traceback = remote_traceback
        self.errors = dict(errors or {rank: (exc_type, message)})
        super().__init__(f"rank {rank} failed with {exc_type}: {message}\n\n{remote_traceback}")

    def __reduce__(self):
        return (type(self), (self.rank, self.exc_type, self.message, self.remote_traceback, self.errors))


class CollectiveError(RuntimeError):
    """A collective that cannot complete because the ranks stopped doing the same thing.

    Raised by every rank that reaches the failure (the message is the same on each), from the
    collective this rank was waiting in. The message names the first collective where the
    ranks' recorded sequences differ (kind, mesh axis, shape, dtype and call site on each rank),
    what every rank is doing now, and the step each rank is in. After it, the process group is
    unusable (a peer is gone, or messages are out of order): end the process.

    Attributes:
        diagnosis: the text of the diagnosis (also the message).
    """

    def __init__(self, message: str):
        super().__init__(message)
        self.diagnosis = message


class CollectiveMismatchError(CollectiveError):
    """The ranks of a group issued different collectives: another kind, axis, shape or dtype,
    or one rank issued a collective the others did not (a branch on the rank or on local data:
    uneven batches, rank-0-only evaluation, a layer run twice on one rank)."""


class RankFailureError(CollectiveError):
    """A peer rank is gone (its process ended or was killed) or frozen (stopped by SIGSTOP or a
    debugger, or not answering), named by rank, host and pid."""


class CollectiveTimeoutError(CollectiveError, TimeoutError):
    """A collective waited the whole timeout (``SHARDLIB_TIMEOUT``) while a peer was busy
    outside any collective; the message names the peer and where it is."""


class CollectiveDeviceError(RuntimeError):
    """A tensor handed to ``torch.distributed`` is not on the mesh's communication device
    (:attr:`shardlib.Mesh.device`: CUDA on NCCL, which rejects CPU tensors), or is not
    contiguous (NCCL's collectives reject it, its sends and receives misread it). Raised before the
    call is issued, in check mode (``SHARDLIB_CHECK_COLLECTIVES=1``, on in the tests), naming
    the call, the tensor and the call site: a shardlib bug, or a tensor of the user's on the
    wrong device."""
