"""On/off environment variables read as words, and a model off the mesh's device refused
before anything communicates (issue 15; found by a review that tried to break it: both failed
before the fix, at 8ed393d too).
"""

import pytest
import torch

import shardlib
from shardlib.testing import run_on


# -- 1. SHARDLIB_NATIVE_COLLECTIVES: "false", "off", "no" turn the native branch ON --------------
def _native_for(value: str):
    """``Mesh.native`` of a fresh one-rank gloo mesh under ``SHARDLIB_NATIVE_COLLECTIVES=value``,
    or the message of the error it raised."""
    import os

    from shardlib.mesh.mesh import Mesh

    old = os.environ.get("SHARDLIB_NATIVE_COLLECTIVES")
    os.environ["SHARDLIB_NATIVE_COLLECTIVES"] = value
    try:
        return Mesh({"x": 1}).native
    except Exception as e:  # a fix may refuse the value instead: it must name the variable
        return str(e)
    finally:
        if old is None:
            os.environ.pop("SHARDLIB_NATIVE_COLLECTIVES")
        else:
            os.environ["SHARDLIB_NATIVE_COLLECTIVES"] = old


@pytest.mark.parametrize("value", ["false", "off", "no"])
def test_native_collectives_variable_read_as_off_or_refused(value):
    """A user who writes SHARDLIB_NATIVE_COLLECTIVES=false gets the exchange branch (native
    False); it used to be True (every value but "" and "0" was on)."""
    got = _native_for(value)
    assert got is False, got


@pytest.mark.parametrize("value", ["1", "true", " ON ", "yes"])
def test_native_collectives_variable_read_as_on(value):
    assert _native_for(value) is True


def test_a_flag_value_not_understood_is_refused_naming_the_variable():
    got = _native_for("maybe")
    assert "SHARDLIB_NATIVE_COLLECTIVES='maybe' is not understood" in got and "'true'" in got, got


# -- 2. a model off mesh.device on a tensor-parallel mesh is not refused before communicating ------
def _tp_off_device_worker(shape):
    from shardlib.errors import ShardingError
    from shardlib.models import GPT, GPTConfig, gpt_preset

    mesh = shardlib.init_mesh(shape)
    mesh.device = torch.device("meta")  # stands in for an NCCL mesh's cuda:0, the model being on the CPU
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=37, block_size=8, n_layer=1, n_head=2, n_embd=8))
    start = mesh.trace.seq
    try:
        shardlib.shard(model, mesh, gpt_preset().specs, zero_stage=1)
    except ShardingError as e:
        return "ShardingError", str(e), mesh.trace.seq - start
    except Exception as e:
        return type(e).__name__, str(e), mesh.trace.seq - start
    return None, "", mesh.trace.seq - start


@pytest.mark.multiprocess
@pytest.mark.parametrize("shape", [{"tp": 2}, {"dp": 2, "tp": 2}], ids=["tp2", "dp2xtp2"])
def test_tensor_parallel_model_off_the_mesh_device_is_refused_before_any_collective(shape):
    """As test_nccl_paths' ZeRO case: a CPU model on a mesh that communicates elsewhere is
    refused on every rank with a ShardingError naming the parameter and both devices, with no
    collective issued. Before the fix the tensor-parallel proof at shard() communicated first."""
    world = 1
    for size in shape.values():
        world *= size
    for kind, message, issued in run_on(world, _tp_off_device_worker, shape):
        assert kind == "ShardingError", (kind, message)
        assert "is on cpu, but the mesh" in message and "communicates on meta" in message, message
        assert issued == 0, issued
