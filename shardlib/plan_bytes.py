"""Memory accounting of a :class:`~shardlib.plan.Plan`: the model-state bytes per rank each
ZeRO stage stores (parameters, gradients, optimizer state), and where they live under
parameter offload (``offload_param_frac``) and optimizer offload (ZeRO-Offload).

:class:`PlanBytes` is a mixin of :class:`~shardlib.plan.Plan`; it uses its ``chunks``,
``effective_stage``, ``optimizer_states``, ``optimizer_offload`` and ``offload_param_frac``.
"""

from __future__ import annotations

__all__ = ["PlanBytes"]


class PlanBytes:
    """Bytes per rank of a plan's model state, on the device and on the host (see the module)."""

    @property
    def param_bytes(self) -> int:
        """Bytes of parameters stored per rank between steps (padding included).

        With ``param_dtype`` (mixed precision) this is the masters plus the persistent compute
        copies: stage 0 a full master and a full compute copy, stages 1-2 the master shard and a
        full compute copy, stage 3 the master shard only (compute copies are gathered per use).
        """
        stage = self.effective_stage
        total = 0
        for c in self.chunks:
            if stage == 3:
                total += c.shard_numel * c.element_size
            elif not c.mixed_compute:
                total += c.padded_numel * c.element_size
            else:
                total += (c.padded_numel if stage == 0 else c.shard_numel) * c.element_size
                total += c.padded_numel * c.compute_element_size
        return total

    @property
    def grad_bytes(self) -> int:
        """Bytes of gradients stored per rank between backward and step (in the master dtype;
        with a ``reduce_dtype`` other than the master's, stage 1 keeps only its shard). Every
        stage releases them at ``zero_grad`` (with ``set_to_none``, the default, as plain
        PyTorch and FSDP2)."""
        stage = self.effective_stage
        total = 0
        for c in self.chunks:
            if c.requires_grad:
                full = stage == 0 or (stage == 1 and not c.separate_grads)
                total += (c.padded_numel if full else c.shard_numel) * c.element_size
        return total

    @property
    def optimizer_bytes(self) -> int:
        """Bytes of optimizer state per rank (``optimizer_states`` tensors per element; AdamW: 2)."""
        stage = self.effective_stage
        per = [c.shard_numel if stage >= 1 else c.padded_numel for c in self.chunks if c.requires_grad]
        size = [c.element_size for c in self.chunks if c.requires_grad]
        return self.optimizer_states * sum(n * s for n, s in zip(per, size))

    @property
    def model_state_bytes(self) -> int:
        return self.param_bytes + self.grad_bytes + self.optimizer_bytes

    @property
    def offloaded_chunks(self) -> tuple[int, ...]:
        """Indices of the chunks whose ZeRO-3 shard lives in host memory (``offload_param_frac``,
        ColossalAI Gemini's ``offload_param_frac``, ZeRO-Infinity's parameter offload): chunks in
        index order until their shard bytes reach the fraction of all shard bytes (every chunk
        at 1.0, none at 0). The same on every rank."""
        if self.offload_param_frac <= 0 or self.effective_stage != 3:
            return ()
        sizes = [c.shard_numel * c.element_size for c in self.chunks]
        goal, total, out = self.offload_param_frac * sum(sizes), 0, []
        for c, size in zip(self.chunks, sizes):
            if total >= goal:
                break
            out.append(c.index)
            total += size
        return tuple(out)

    def offloaded_shard_bytes(self, trainable: bool = False) -> int:
        """Shard bytes per rank of the offloaded chunks (only the trainable ones with ``trainable``)."""
        off = set(self.offloaded_chunks)
        return sum(c.shard_numel * c.element_size for c in self.chunks
                   if c.index in off and (c.requires_grad or not trainable))

    @property
    def param_offload_bytes(self) -> int:
        """Host bytes per rank of the offloaded chunks: their shards, their gradient shards and
        (where the optimizer updates them on the host) their optimizer state."""
        return self.offloaded_shard_bytes() + self.offloaded_shard_bytes(True) * (1 + self.optimizer_states)

    @property
    def host_bytes(self) -> int:
        """Bytes per rank in host memory: under ``optimizer_offload`` (ZeRO-Offload) the optimizer
        state, a master copy of the shards the optimizer updates and their gradients; with
        ``offload_param_frac`` the offloaded chunks' :attr:`param_offload_bytes` (their optimizer
        state once); else 0."""
        total = self.param_offload_bytes
        if self.optimizer_offload:  # the chunks still on the device: ZeRO-Offload's copies and state
            stage = self.effective_stage
            on_device = sum((c.shard_numel if stage >= 1 else c.padded_numel) * c.element_size for c in self.chunks
                            if c.requires_grad) - self.offloaded_shard_bytes(True)
            total += (self.optimizer_states + 2) * on_device
        return total

    @property
    def device_state_bytes(self) -> int:
        """Model-state bytes per rank on the compute device: ``model_state_bytes`` less the
        optimizer state when it is offloaded and less :attr:`param_offload_bytes`."""
        states = self.optimizer_bytes if self.optimizer_offload else 0
        if states:  # the offloaded chunks' state is in both figures: once
            states -= self.optimizer_states * self.offloaded_shard_bytes(True)
        return self.model_state_bytes - states - self.param_offload_bytes
