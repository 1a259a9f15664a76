"""The strategies a Plan lowers to: one file per technique."""

from .zero import ZeroRuntime

__all__ = ["ZeroRuntime"]
