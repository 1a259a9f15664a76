"""Testing support: equivalence against a single process, the worker pool, strategies."""

from .equivalence import assert_equivalent, default_tolerances, loss_of
from .models import TiedLM
from .pool import close_pools, get_pool, run_on

__all__ = ["assert_equivalent", "default_tolerances", "loss_of", "TiedLM", "get_pool", "run_on", "close_pools"]
