"""Defects found while trying to break issue 15's work (review branch h-break).

Each test is ``xfail(strict=True)``: it reproduces a defect on today's main and will start to
pass (and so fail the run, as strict xfail does) once the defect is fixed; then drop the marker.
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


@pytest.mark.xfail(strict=True, reason="mesh.py:288 treats every value but '' and '0' as on: 'false', 'off' and "
                                       "'no' force the native collectives on gloo, silently (SHARDLIB_KERNELS in "
                                       "kernels/_dispatch.py reads the same words as off, and warns on others)")
@pytest.mark.parametrize("value", ["false", "off", "no"])
def test_native_collectives_variable_read_as_off_or_refused(value):
    """A user who writes SHARDLIB_NATIVE_COLLECTIVES=false gets the exchange branch (native
    False), or an error naming the variable; today native is True."""
    got = _native_for(value)
    assert got is False or (isinstance(got, str) and "SHARDLIB_NATIVE_COLLECTIVES" in got), got


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
@pytest.mark.xfail(strict=True, reason="only ZeRO checks devices (parallel/zero.py _check_devices, at ZeroRunner "
                                       "construction); shard.py:302 runs verify_tensor_parallel first, whose "
                                       "all-reduce (tensor_verify.py:141-143) takes a tensor on the model's device, "
                                       "so a CPU model on an NCCL tp mesh reaches a collective: on meta it dies in "
                                       "check mode's fingerprint (NotImplementedError: Cannot copy out of meta tensor)")
@pytest.mark.parametrize("shape", [{"tp": 2}, {"dp": 2, "tp": 2}], ids=["tp2", "dp2xtp2"])
def test_tensor_parallel_model_off_the_mesh_device_is_refused_before_any_collective(shape):
    """As test_nccl_paths' ZeRO case: a CPU model on a mesh that communicates elsewhere is
    refused on every rank with a ShardingError naming the parameter and both devices, with no
    collective issued. Today the tensor-parallel proof at shard() communicates first."""
    world = 1
    for size in shape.values():
        world *= size
    for kind, message, issued in run_on(world, _tp_off_device_worker, shape):
        assert kind == "ShardingError", (kind, message)
        assert "is on cpu, but the mesh" in message and "communicates on meta" in message, message
        assert issued == 0, issued
