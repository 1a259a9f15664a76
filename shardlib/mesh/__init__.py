"""Mesh, launch, and collectives by mesh axis name."""

from .collectives import all_gather, all_reduce, all_to_all, ppermute, pvary, reduce_scatter
from .comm import CommCounter, ring_bytes
from .launch import WorkerGroup, launch
from .mesh import AbstractMesh, Mesh, current_mesh, default_timeout, init_mesh

__all__ = [
    "AbstractMesh",
    "Mesh",
    "init_mesh",
    "current_mesh",
    "default_timeout",
    "launch",
    "WorkerGroup",
    "CommCounter",
    "ring_bytes",
    "all_reduce",
    "pvary",
    "all_gather",
    "reduce_scatter",
    "all_to_all",
    "ppermute",
]
