"""shardlib/__init__.py is the public surface: the contract names exist, are documented, and
nothing else public leaks in."""

import inspect

import shardlib

CONTRACT = [
    "init_mesh", "Mesh", "launch", "PartitionSpec", "P", "annotate", "plan", "shard", "ZeroOptimizer",
    "clip_grad_norm_", "full_state_dict", "distribute", "all_reduce", "all_gather", "reduce_scatter",
    "all_to_all", "ppermute",
]


def test_contract_names_are_exported():
    for name in CONTRACT:
        assert name in shardlib.__all__, name
        assert hasattr(shardlib, name), name
    assert shardlib.P is shardlib.PartitionSpec
    from shardlib import testing

    assert callable(testing.assert_equivalent)


def test_checkpoint_contract():
    """``checkpoint.save``/``checkpoint.load`` (DESIGN.md), reached as ``shardlib.checkpoint``."""
    assert "checkpoint" in shardlib.__all__
    for name in ("save", "load", "export_safetensors"):
        assert inspect.getdoc(getattr(shardlib.checkpoint, name)), name


def test_every_public_name_exists_and_is_documented():
    for name in shardlib.__all__:
        obj = getattr(shardlib, name)
        if inspect.isfunction(obj) or inspect.isclass(obj):
            assert inspect.getdoc(obj), f"{name} has no docstring"


def test_no_undeclared_public_functions():
    public = {n for n, v in vars(shardlib).items() if not n.startswith("_") and (inspect.isfunction(v) or inspect.isclass(v))}
    assert public <= set(shardlib.__all__), public - set(shardlib.__all__)
