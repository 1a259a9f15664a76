"""Training configs (shardlib.config): Python files of sections loaded into a checked attribute
dict, defaults filled in, overrides section.key=value, refusals naming the key path and source;
the shipped configs plan without error."""

import glob
import os

import pytest
import torch

import shardlib
from shardlib.config import SCHEMA, Config, ConfigError, load_config
from shardlib.mesh import AbstractMesh
from shardlib.models import GPTConfig

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _write(tmp_path, text):
    path = tmp_path / "cfg.py"
    path.write_text(text)
    return str(path)


def test_a_file_with_defaults_and_overrides(tmp_path):
    """Sections from the file, every other key its default, overrides applied in order as
    Python literals (a bare word is a string); attribute access on nested sections."""
    path = _write(tmp_path, 'import math\n_hidden = 3\nparallel = dict(mesh={"dp": 2}, zero_stage=3)\n'
                            'model = dict(builder="gpt", n_layer=2)\ntrain = dict(steps=10)\n')
    cfg = load_config(path, ["train.steps=20", "optim.decay=linear", "optim.betas=(0.9, 0.99)", "train.steps=30"])
    assert isinstance(cfg, Config) and set(cfg) == set(SCHEMA)
    assert cfg.train.steps == 30 and cfg.optim.decay == "linear" and cfg.optim.betas == (0.9, 0.99)
    assert cfg.parallel.mesh == {"dp": 2} and cfg.parallel.zero_stage == 3
    assert cfg.model.n_layer == 2 and cfg.model.n_embd == GPTConfig().n_embd  # the builder's default
    assert cfg.train.global_batch == SCHEMA["train"]["global_batch"][1]
    assert cfg.to_dict()["train"]["steps"] == 30 and type(cfg.to_dict()["train"]) is dict
    with pytest.raises(AttributeError, match="no key 'stpes'"):
        cfg.train.stpes


@pytest.mark.parametrize("text,overrides,needle", [
    ("train = dict(stpes=10)\n", [], "config key 'train.stpes' (from "),
    ("train = dict(steps='10')\n", [], "'train.steps' (from "),
    ("train = dict(steps=True)\n", [], "must be int, got bool True"),
    ("trian = dict(steps=10)\n", [], "assigns 'trian', which is not a section"),
    ("train = 5\n", [], "section 'train'"),
    ("model = dict(builder='gpt', n_layers=2)\n", [], "'model.n_layers'"),
    ("model = dict(builder='bert')\n", [], "'model.builder'"),
    ("raise RuntimeError('boom')\n", [], "raised RuntimeError: boom"),
    ("", ["train.steps"], "must be written section.key=value"),
    ("", ["steps=3"], "must be written section.key=value"),
    ("", ["trian.steps=3"], "names section 'trian'"),
    ("", ["train.steps=ten"], "override 'train.steps=ten'"),
    ("", ["optim.lr=fast"], "'optim.lr' (override"),
])
def test_bad_configs_are_refused_naming_the_key(tmp_path, text, overrides, needle):
    with pytest.raises(ConfigError) as info:
        load_config(_write(tmp_path, text), overrides)
    assert needle in str(info.value), str(info.value)
    assert isinstance(info.value, ValueError)


def test_missing_file():
    with pytest.raises(ConfigError, match="does not exist"):
        load_config("/nonexistent/cfg.py")


@pytest.mark.parametrize("path", sorted(glob.glob(os.path.join(ROOT, "configs", "*.py"))))
def test_every_shipped_config_loads_and_plans(path):
    """Each file in configs/ loads, passes the training tool's cross-key checks, and its model
    and parallel layout plan on an abstract mesh of its shape, with the specs and options the
    tool passes (no processes: a layout for a cluster is checked here, not trained). A ``-1``
    axis is planned at 2 ranks."""
    import math

    from shardlib.train.build import build_model, check_run, sharding

    cfg = load_config(path)
    world = math.prod(n if n != -1 else 2 for n in cfg.parallel.mesh.values())
    shape = check_run(cfg, world)
    with torch.device("meta"):
        model = build_model(cfg)
    specs, options = sharding(cfg, shape, model)
    plan = shardlib.plan(model, AbstractMesh(shape), specs, **options)
    assert plan.params if hasattr(plan, "params") else plan.stages
