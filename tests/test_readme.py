"""README's two set-up commands exist, and CI runs the test command verbatim."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _commands():
    text = (ROOT / "README.md").read_text()
    return re.findall(r"```bash\n(.*?)\n```", text, flags=re.S)


def test_readme_has_exactly_two_setup_commands():
    commands = _commands()
    assert len(commands) == 2, commands
    main, tests = commands
    assert "torchrun" in main and "examples/train_gpt.py" in main and "--zero-stage 3" in main
    assert "pytest" in tests
    for command in commands:
        assert 'torch==2.13.0' in command, "the CPU install must pin torch so no CUDA build is pulled"


def test_ci_runs_the_readme_test_command():
    ci = (ROOT / ".ci" / "run").read_text()
    assert _commands()[1] in ci
