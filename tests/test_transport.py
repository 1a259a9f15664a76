"""The worker group's messages: plain CPU tensors as raw bytes, everything else as torch pickles it."""

import pytest
import torch
from torch import nn

from shardlib.mesh import transport
from shardlib.testing import run_on


def _no_torch_save(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("torch.save was called: a plain tensor took torch's pickling path")

    monkeypatch.setattr(torch.serialization, "save", refuse)
    monkeypatch.setattr(torch, "save", refuse)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.int64,
                                   torch.int8, torch.uint8, torch.bool, torch.complex64, torch.float8_e4m3fn])
def test_plain_tensors_arrive_bit_for_bit_without_torch_save(monkeypatch, dtype):
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(5, 7, generator=g) * 3).to(dtype)
    sent = [x, x.t(), x[1:4, ::2], x[2, 3], torch.empty(0, 3, dtype=dtype), torch.tensor(7).to(dtype)]
    _no_torch_save(monkeypatch)
    got = transport.loads(transport.dumps(sent))
    for a, b in zip(sent, got):
        assert type(b) is torch.Tensor and b.dtype == a.dtype and b.shape == a.shape and b.stride() == a.stride()
        assert b.storage_offset() == a.storage_offset()
        assert torch.equal(a.reshape(-1).contiguous().view(torch.uint8), b.reshape(-1).contiguous().view(torch.uint8))


def test_views_of_one_storage_stay_views_of_one_storage():
    flat = torch.arange(12.0)
    a, b = flat[:6].view(2, 3), flat[6:]
    got_flat, got_a, got_b, again = transport.loads(transport.dumps([flat, a, b, (a, {"b": b})]))
    got_flat[0] = 100.0
    got_flat[7] = -1.0
    assert got_a[0, 0] == 100.0 and got_b[1] == -1.0  # one buffer, as torch.save keeps it (cloudpickle made copies)
    assert again[0].untyped_storage().data_ptr() == got_flat.untyped_storage().data_ptr()
    assert torch.equal(again[1]["b"], got_b)
    other = torch.arange(3.0)  # a separate tensor stays separate
    x, y = transport.loads(transport.dumps([other, other.clone()]))
    x[0] = 9.0
    assert y[0] == 0.0


def test_everything_else_takes_torchs_path():
    p = nn.Parameter(torch.randn(3))
    leaf = torch.randn(2, requires_grad=True)
    tagged = torch.randn(2)
    tagged.note = "kept"
    sparse = torch.eye(3).to_sparse()
    model = nn.Linear(3, 2)
    got_p, got_leaf, got_tagged, got_sparse, got_model = transport.loads(
        transport.dumps([p, leaf, tagged, sparse, model]))
    assert type(got_p) is nn.Parameter and got_p.requires_grad and torch.equal(got_p, p)
    assert got_leaf.requires_grad and torch.equal(got_leaf, leaf)
    assert got_tagged.note == "kept" and torch.equal(got_tagged, tagged)
    assert got_sparse.is_sparse and torch.equal(got_sparse.to_dense(), torch.eye(3))
    assert torch.equal(got_model.weight, model.weight) and got_model.weight.requires_grad


def _views_on_a_rank(flat):
    return {"flat": flat, "head": flat[:2], "sum": float(flat.sum())}


@pytest.mark.multiprocess
def test_a_worker_group_round_trip_keeps_values_and_views():
    flat = torch.arange(6, dtype=torch.float64)
    (out,) = run_on(1, _views_on_a_rank, flat)
    assert out["sum"] == 15.0 and torch.equal(out["flat"], flat)
    out["flat"][0] = 42.0
    assert out["head"][0] == 42.0
