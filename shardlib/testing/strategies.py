"""Hypothesis strategies for meshes, specs and awkward sizes."""

from __future__ import annotations

from hypothesis import strategies as st

from ..spec import P

__all__ = ["mesh_shapes", "awkward_sizes", "data_axis_specs"]


@st.composite
def mesh_shapes(draw, axes=("dp", "fsdp"), max_world: int = 4, min_world: int = 1):
    """``{axis: size}`` dicts over ``axes`` (in order) whose product is in [min_world, max_world];
    sizes of 1 included, since a size-1 axis must cost nothing."""
    shape = {}
    world = 1
    for axis in axes:
        size = draw(st.integers(1, max(1, max_world // world)))
        shape[axis] = size
        world *= size
    if world < min_world:
        shape[axes[0]] *= -(-min_world // world)
    return shape


def awkward_sizes(low: int = 1, high: int = 41):
    """Dimension sizes biased toward primes and sizes no mesh axis divides."""
    return st.one_of(st.sampled_from([1, 3, 5, 7, 10, 13, 37, 41]), st.integers(low, high))


@st.composite
def data_axis_specs(draw, param_names, ndims, data_axes=("dp",)):
    """A ``{name: spec}`` mapping sharding some parameters along data axes (ZeRO-3 storage)."""
    specs = {}
    for name, ndim in zip(param_names, ndims):
        if ndim and draw(st.booleans()):
            dim = draw(st.integers(0, ndim - 1))
            axes = draw(st.lists(st.sampled_from(list(data_axes)), min_size=1, max_size=len(data_axes), unique=True))
            entries = [None] * ndim
            entries[dim] = tuple(axes) if len(axes) > 1 else axes[0]
            specs[name] = P(*entries)
    return specs
