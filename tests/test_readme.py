"""README's two set-up commands exist, and CI runs the test command verbatim."""

import re

import pytest
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _commands():
    text = (ROOT / "README.md").read_text()
    return re.findall(r"```bash\n(.*?)\n```", text, flags=re.S)


def test_readme_has_exactly_two_setup_commands():
    commands = _commands()
    assert len(commands) == 2, commands
    main, tests = commands
    assert "torchrun" in main and "-m shardlib.train --config configs/embedded_default.py" in main
    assert "pytest" in tests
    for command in commands:
        assert 'torch==2.13.0' in command, "the CPU install must pin torch so no CUDA build is pulled"


def test_ci_runs_the_readme_test_command():
    ci = (ROOT / ".ci" / "run").read_text()
    assert _commands()[1] in ci


def _python_blocks():
    text = (ROOT / "README.md").read_text()
    return re.findall(r"```python\n(.*?)\n```", text, flags=re.S)


def _world_size(code: str) -> int:
    """The world size a block's meshes need (every init_mesh call in a block has one product)."""
    import ast

    sizes = set()
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", "")) == "init_mesh":
            shape = ast.literal_eval(node.args[0])
            n = 1
            for v in shape.values():
                n *= v
            sizes.add(n)
    assert len(sizes) <= 1, f"a README block uses meshes of different sizes {sizes}"
    return sizes.pop() if sizes else 1


def _exec_block(code: str, folder: str):
    import contextlib
    import io
    import os

    os.chdir(folder)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, "README.md", "exec"), {"__name__": "__readme__"})
    return out.getvalue()


@pytest.mark.multiprocess
@pytest.mark.parametrize("index", range(len(_python_blocks())))
def test_readme_python_block_runs(index, tmp_path):
    """Every Python block of README.md runs as written, on the ranks its meshes need (so the
    README cannot drift from the API again: issue 12)."""
    from shardlib.testing import run_on

    code = _python_blocks()[index]
    outputs = run_on(_world_size(code), _exec_block, code, str(tmp_path))
    if "print(shardlib.plan(" in code:
        assert "model state per rank" in outputs[0]
    if "activation_offload.stats" in code:  # the context's ratio is what smodel reports
        assert "offloaded_bytes=0," not in outputs[0] and "saved_bytes=0," not in outputs[0], outputs[0]


def test_public_subpackages_are_reachable_from_import_shardlib():
    """``import shardlib`` then ``shardlib.models.GPT`` (README's first block) in a fresh
    interpreter: every public subpackage is an attribute, imported on first use."""
    import subprocess
    import sys

    code = ("import shardlib; print(shardlib.models.GPT.__name__, shardlib.testing.assert_equivalent.__name__, "
            "shardlib.checkpoint.save.__name__, shardlib.kernels.__name__, shardlib.parallel.__name__, "
            "shardlib.mesh.__name__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["GPT", "assert_equivalent", "save", "shardlib.kernels", "shardlib.parallel", "shardlib.mesh"]
