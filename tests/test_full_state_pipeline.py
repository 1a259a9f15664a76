"""full_state_dict of a pipeline: every stage's tensors gathered as tensors, never pickled.

The stages exchange only names, shapes and dtypes as Python objects (``all_gather_object`` is
wrapped to refuse any tensor or storage inside what it sends); the tensors go as one flat
buffer per pp rank, broadcast over the pipeline axis (to every rank) or sent to rank 0 alone
(``rank0_only``), and counted in ``mesh.comm``. The result equals the unsharded model's
``state_dict`` exactly.
"""

import contextlib
import io
import pickle

import pytest
import torch

import shardlib
from shardlib.models import GPT, GPTConfig
from shardlib.testing import run_on

pytestmark = pytest.mark.multiprocess


class _NoTensors(pickle.Pickler):
    def persistent_id(self, obj):
        if isinstance(obj, (torch.Tensor, torch.UntypedStorage, torch.TypedStorage)):
            raise AssertionError(f"a {type(obj).__name__} was pickled into all_gather_object")
        return None


@contextlib.contextmanager
def _objects_without_tensors(seen: list):
    import torch.distributed as dist

    gather = dist.all_gather_object

    def checked(out, obj, group=None):
        _NoTensors(io.BytesIO()).dump(obj)
        seen.append(obj)
        return gather(out, obj, group=group)

    dist.all_gather_object = checked
    try:
        yield
    finally:
        dist.all_gather_object = gather


def _config():
    # every tensor's bytes a multiple of 16 (the flat buffer's alignment): the counted bytes are the tensors'
    return GPTConfig(vocab_size=36, block_size=8, n_layer=2, n_head=2, n_embd=16, bias=False)


def _full_state_worker(shape: dict, zero_stage: int):
    mesh = shardlib.init_mesh(shape)
    torch.manual_seed(0)
    ref = GPT(_config()).state_dict()
    torch.manual_seed(0)
    smodel = shardlib.shard(GPT(_config()), mesh, microbatches=2, zero_stage=zero_stage)
    seen: list = []
    out = {}
    with _objects_without_tensors(seen):
        for rank0_only in (False, True):
            mesh.comm.reset()
            full = shardlib.full_state_dict(smodel, rank0_only=rank0_only)
            out[rank0_only] = {
                "equal": list(full) == list(ref) and all(torch.equal(full[k], ref[k]) for k in ref) if full else None,
                "empty": full == {}, "bytes": sum(t.numel() * t.element_size() for t in ref.values()),
                "broadcast": mesh.comm.bytes("pp", "broadcast"), "sent": mesh.comm.bytes("pp", "send"),
                "objects": len(seen)}
    stage_bytes = sum(ref[k].numel() * ref[k].element_size() for k in smodel.module.state_dict(keep_vars=True))
    return {"rank": mesh.rank, "rank0_group": 0 in mesh.axis_ranks("pp"), "stage_bytes": stage_bytes, **out}


@pytest.mark.parametrize("shape,zero_stage", [({"pp": 2}, 0), ({"pp": 2, "dp": 2}, 3)])
def test_pipeline_full_state_dict_moves_tensors_not_pickles(shape, zero_stage):
    results = run_on(2 * shape.get("dp", 1), _full_state_worker, shape, zero_stage)
    for r in results:
        every, rank0 = r[False], r[True]
        assert every["equal"] is True  # every rank, in state_dict order, bit for bit
        # each pp rank's buffer broadcast to the other: per rank (N - 1) / N of all stages' bytes
        assert every["broadcast"] == every["bytes"] / 2 and every["sent"] == 0 and every["objects"] == 1
        if r["rank"] == 0:
            assert rank0["equal"] is True and rank0["sent"] == 0
        else:
            assert rank0["empty"]
            # only rank 0's pp partner sends, its whole stage; pp groups without rank 0 exchange nothing
            assert rank0["sent"] == (r["stage_bytes"] if r["rank0_group"] else 0)
        assert rank0["broadcast"] == 0 and rank0["objects"] == every["objects"] + r["rank0_group"]


class _Scaled(torch.nn.Module):
    """GPT with a persistent buffer of shape (8,)."""

    def __init__(self):
        super().__init__()
        self.gpt = GPT(_config())
        self.register_buffer("scale", torch.ones(8))


def _round_trip_worker():
    """A pipeline's full_state_dict loaded back with strict=True (it raised: the other stage's
    keys were "unexpected" after this stage's were written); a buffer of the wrong shape (it
    was broadcast by copy_) and a parameter of the wrong shape are refused before any write."""
    mesh = shardlib.init_mesh({"pp": 2})
    torch.manual_seed(0)
    smodel = shardlib.shard(GPT(_config()), mesh, microbatches=2)
    state = shardlib.full_state_dict(smodel)
    changed = {k: v + 1 for k, v in state.items()}
    out = {"round trip": smodel.load_state_dict(changed, strict=True)}
    after = shardlib.full_state_dict(smodel)
    out["equal"] = all(torch.equal(after[k], changed[k]) for k in changed)
    out["extra"] = smodel.load_state_dict({**changed, "not.a.key": torch.zeros(1)}, strict=False)[1]
    bad = dict(changed)
    first = next(iter(bad))
    bad[first] = torch.zeros(1, *bad[first].shape)
    try:
        smodel.load_state_dict({k: v - 1 for k, v in bad.items()})
    except RuntimeError as e:
        out["bad parameter"] = str(e)
    out["unchanged"] = all(torch.equal(v, changed[k]) for k, v in shardlib.full_state_dict(smodel).items())
    # one name of the tensor tied across the stages (save_pretrained keeps one): the last stage
    # (lm_head) found only its own name, raised alone with strict, and with strict=False kept its
    # old values, so the embedding and the LM head differed, silently
    one_name = {k: v * 3 for k, v in changed.items() if k != "lm_head.weight"}
    out["one name of a tie"] = smodel.load_state_dict(one_name, strict=True)
    after = shardlib.full_state_dict(smodel)
    out["tie loaded"] = torch.equal(after["lm_head.weight"], one_name["wte.weight"]) and \
        torch.equal(after["wte.weight"], one_name["wte.weight"])
    # what is missing is judged over the whole model, the same on every rank (each stage listed its own)
    out["missing"] = smodel.load_state_dict({k: v for k, v in changed.items() if "blocks.1." not in k
                                             and k not in ("wte.weight", "lm_head.weight")}, strict=False)[0]
    dp = shardlib.init_mesh({"dp": 2})
    torch.manual_seed(0)
    scaled = shardlib.shard(_Scaled(), dp)
    full = shardlib.full_state_dict(scaled)
    try:
        scaled.load_state_dict({**full, "scale": torch.full((1,), 5.0)})
    except RuntimeError as e:
        out["bad buffer"] = str(e)
    out["buffer kept"] = scaled.module.scale.tolist()
    return out


def test_a_pipeline_loads_its_full_state_dict_strictly_and_wrong_shapes_change_nothing():
    for out in run_on(2, _round_trip_worker):
        assert out["round trip"] == ([], []) and out["equal"], out
        assert out["extra"] == ["not.a.key"], out
        assert "has shape (1, " in out["bad parameter"] and out["unchanged"], out
        assert out["one name of a tie"] == ([], []) and out["tie loaded"], out
        assert out["missing"] == ["wte.weight"] + [k for k in GPT(_config()).state_dict() if "blocks.1." in k], out
        assert out["bad buffer"] == "load_full_state_dict: scale has shape (1,), expected (8,)", out
        assert out["buffer kept"] == [1.0] * 8, out
