"""The in-place check torch makes on saved tensors, kept where shardlib's saved-tensor hooks
(ZeRO-3's chunk views, activation offload) hold them.

Without hooks, autograd records each saved tensor's version counter and raises in backward when
an in-place op changed it since ("one of the variables needed for gradient computation has been
modified by an inplace operation"). A tensor packed by ``torch.autograd.graph.saved_tensors_hooks``
skips that check, so a model that is wrong in one process (``s = sigmoid(h); z = b(s); s.mul_(3)``)
trained on silently wrong gradients under ZeRO-3 or ``offload_ratio``. :func:`keep` records the
version at pack time and :func:`take` checks it at unpack, with torch's message.
"""

from __future__ import annotations

import torch

__all__ = ["Saved", "keep", "take", "check_version"]


class Saved:
    """A saved tensor held as it is, with its version counter at pack time."""

    __slots__ = ("t", "version")

    def __init__(self, t: torch.Tensor):
        self.t, self.version = t, t._version


def keep(t: torch.Tensor) -> Saved:
    """Pack ``t`` as it is (no copy), remembering its version."""
    return Saved(t)


def take(saved: Saved) -> torch.Tensor:
    """Unpack: the tensor, after :func:`check_version`."""
    check_version(saved.t, saved.version)
    return saved.t


def check_version(t: torch.Tensor, version: int) -> None:
    """Raise torch's error when ``t`` changed in place since it was saved at ``version``.

    Raises:
        RuntimeError: ``t._version != version`` (as autograd raises without saved-tensor hooks)."""
    now = t._version
    if now != version:
        raise RuntimeError(
            "one of the variables needed for gradient computation has been modified by an inplace operation: "
            f"[{t.type()} {list(t.shape)}] is at version {now}; expected version {version} instead. (shardlib's "
            "saved-tensor hooks, under ZeRO-3 or activation offload, make the check torch makes without them.) Hint: "
            "use an out-of-place op on the tensor after it has been used (x = x * 3, not x.mul_(3))")
