"""Which function applies which kind of plan: a registry, so a plan never imports its module type.

``Plan.apply(model)`` and ``PipelinePlan.apply(model)`` call :func:`lower`, which looks the
plan's type up here; :mod:`shardlib.shard` registers the lowerings (``ShardedModule`` for a
:class:`~shardlib.plan.Plan`, the pipeline stage for a
:class:`~shardlib.pipeline_plan.PipelinePlan`) when the package is imported. The planner modules
stay below the modules they lower to.
"""

from __future__ import annotations

from typing import Any, Callable

__all__ = ["register_lowering", "lower"]

_LOWERINGS: dict[type, Callable[[Any, Any], Any]] = {}


def register_lowering(plan_type: type) -> Callable:
    """Decorator: ``fn(plan, model) -> module`` applies plans of ``plan_type``."""

    def register(fn: Callable[[Any, Any], Any]) -> Callable[[Any, Any], Any]:
        _LOWERINGS[plan_type] = fn
        return fn

    return register


def lower(plan: Any, model: Any) -> Any:
    """Apply ``plan`` to ``model`` with the lowering registered for its type.

    Raises:
        TypeError: no lowering is registered for the plan's type (``shardlib.shard`` not imported).
    """
    for cls in type(plan).__mro__:
        if cls in _LOWERINGS:
            return _LOWERINGS[cls](plan, model)
    raise TypeError(f"no lowering registered for {type(plan).__name__}; import shardlib (shardlib.shard registers them)")
