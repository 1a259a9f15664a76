"""The end of a backward nested inside an outer one, told apart from the outer's end.

A reentrant activation checkpoint (``torch.utils.checkpoint(..., use_reentrant=True)``) runs its
recompute and then a whole ``torch.autograd.backward`` of its own from inside its node's backward:
a second graph task, nested in the outer one. Gradient hooks cannot tell the two apart, so the
end-of-backward callback ZeRO queues from the first gradient of a backward lands on the nested
task when that gradient comes inside the checkpoint (its region is the last of the model's
forward), and would reduce before the gradients outside the checkpoint exist. FSDP avoids this
with a hook on the root outputs' gradients; shardlib's stages 0-2 have no root post-forward hook
(they compile in one graph), so the callback checks, when it runs, whether an outer node is
still being evaluated (``torch._C._current_autograd_node()``: None at the end of a top-level
backward, the checkpoint's node at a nested one's end) and if so moves itself onto the outer
backward once that node is done.
"""

from __future__ import annotations

from typing import Callable

import torch

__all__ = ["defer_to_outer_backward"]


def defer_to_outer_backward(queue_callback: Callable[[], None]) -> bool:
    """Called by an end-of-backward callback: inside a nested backward, arrange for
    ``queue_callback()`` to run right after the outer node being evaluated (it then queues the
    callback on the outer backward) and return True (the caller ends nothing now); at the end of
    a top-level backward return False."""
    node = torch._C._current_autograd_node()
    if node is None:
        return False

    def after_node(grad_inputs, grad_outputs):
        handle.remove()
        queue_callback()

    handle = node.register_hook(after_node)
    return True
