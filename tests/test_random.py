"""Mesh-independent random numbers: any sharding sees slices of one global draw."""

import functools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import shardlib
from shardlib.models import GPTConfig, tp_specs
from shardlib.random import MeshDropout, counter_normal_, counter_uniform, mesh_independent_dropout
from shardlib.spec import shard_range
from shardlib.testing import assert_equivalent
from shardlib.testing.models import gpt_for_tests


@settings(max_examples=25, deadline=None)
@given(
    shape=st.lists(st.integers(1, 7), min_size=1, max_size=3),
    parts=st.integers(1, 4),
    dim=st.integers(0, 2),
    seed=st.integers(0, 2**31),
)
def test_shards_are_slices_of_the_global_draw(shape, parts, dim, seed):
    dim = dim % len(shape)
    whole = counter_uniform(seed, 3, 1, shape)
    pieces = []
    for i in range(parts):
        lo, hi = shard_range(shape[dim], parts, i)
        local = list(shape)
        local[dim] = hi - lo
        offsets = [0] * len(shape)
        offsets[dim] = lo
        pieces.append(counter_uniform(seed, 3, 1, local, shape, offsets))
    assert torch.equal(torch.cat(pieces, dim=dim), whole)


def test_uniform_statistics_and_key_separation():
    u = counter_uniform(0, 0, 0, (200_000,))
    assert 0.0 <= u.min() and u.max() < 1.0
    assert abs(u.mean().item() - 0.5) < 0.005 and abs(u.var().item() - 1 / 12) < 0.002
    assert not torch.equal(u, counter_uniform(0, 0, 1, (200_000,)))  # counter
    assert not torch.equal(u, counter_uniform(0, 1, 0, (200_000,)))  # stream
    assert not torch.equal(u, counter_uniform(1, 0, 0, (200_000,)))  # seed
    z = counter_normal_(torch.empty(100_000), 2.0, seed=1, stream=2)
    assert abs(z.mean().item()) < 0.03 and abs(z.std().item() - 2.0) < 0.03


def test_dropout_mask_equals_single_device_slice():
    """A data-parallel rank and a sequence-parallel rank draw their slice of the global mask."""
    x = torch.ones(4, 6, 3)
    whole = MeshDropout(0.5, seed=7, stream=1)
    full = whole(x)
    for batch_index in range(2):
        for seq_index in range(3):
            drop = MeshDropout(0.5, seed=7, stream=1)
            drop.batch_parts, drop.batch_index, drop.seq_parts, drop.seq_index = 2, batch_index, 3, seq_index
            local = drop(x[2 * batch_index : 2 * batch_index + 2, 2 * seq_index : 2 * seq_index + 2])
            assert torch.equal(local, full[2 * batch_index : 2 * batch_index + 2, 2 * seq_index : 2 * seq_index + 2])
    assert 0.3 < (full == 0).float().mean() < 0.7
    whole.eval()
    assert torch.equal(whole(x), x)


def test_mesh_independent_dropout_replaces_every_dropout_module():
    from shardlib.models import GPT

    model = GPT(GPTConfig(vocab_size=11, block_size=4, n_layer=2, n_head=2, n_embd=8, dropout=0.1))
    made = mesh_independent_dropout(model, seed=3)
    assert len(made) == 1 + 2 * 2 and not any(type(m) is torch.nn.Dropout for m in model.modules())
    assert len({m.stream for m in made}) == len(made)


def _batch(rows):
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 37, (rows, 9), generator=g)
    return x[:, :-1], x[:, 1:]


@pytest.mark.multiprocess
@pytest.mark.parametrize("shape,sp", [({"dp": 2}, False), ({"tp": 2}, False), ({"dp": 2, "tp": 2}, True)])
def test_dropout_training_equals_single_device(shape, sp):
    """With dropout 0.2 the sharded run (data, tensor and sequence parallel) equals one process:
    the masks are the single-device masks."""
    cfg = GPTConfig(vocab_size=37, block_size=8, n_layer=2, n_head=2, n_embd=16, dropout=0.2)
    specs = dict(tp_specs(), **{"wte.weight": shardlib.P("tp", None)}) if "tp" in shape else None
    assert_equivalent(functools.partial(gpt_for_tests, cfg), shape, specs, _batch(4), steps=3, zero_stage=3 if sp else 0,
                      chunk_size=500, sequence_parallel=sp, optimizer_kwargs={"lr": 1e-3}, dropout_seed=5)
