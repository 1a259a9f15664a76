"""The command-line half of the bad-input catalogue: the example scripts' flags.

Each case runs a script's ``parse_args(argv)`` in process (no subprocess, no torchrun): under
torchrun every rank parses the same argv, so the catalogue runs them on every rank of the pool
too. A refusal is a ``SystemExit`` whose message is the one usage line
(``train_gpt.py: error: argument --steps: ...``) that :func:`shardlib.cli.main_guard` prints
once; it must come at parse time, before ``init_mesh``. The pool's workers have
``WORLD_SIZE=2``, so the default mesh is ``dp=2``.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

from bad_inputs_api import Case, M

ROOT = Path(__file__).resolve().parents[1]
PARSE = "parse_args(argv), from entry until it raises (parse time: before init_mesh)"


def load_example(name: str):
    """``examples/<name>.py`` as a module (its ``main()`` is not run)."""
    module_name = f"_example_{name}"
    if module_name not in sys.modules:
        spec = importlib.util.spec_from_file_location(module_name, ROOT / "examples" / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[module_name] = module
        spec.loader.exec_module(module)
    return sys.modules[module_name]


def env_cli(tmp: str) -> dict:
    return {"train_gpt": load_example("train_gpt"), "train_hf": load_example("train_hf")}


def parse(module, script: str, argv: list[str]):
    """``module.parse_args(argv)`` with ``sys.argv[0]`` the script's path, as under torchrun
    (argparse names the program after it)."""
    saved = sys.argv
    sys.argv = [str(ROOT / "examples" / f"{script}.py"), *argv]
    try:
        return module.parse_args(argv)
    finally:
        sys.argv = saved


def _flag(script: str, args: tuple, match: str, xfail: str | None = None) -> Case:
    argv = list(args)
    return Case("cli", f"{script}:{' '.join(argv)}", lambda e: parse(e[script], script, argv), SystemExit,
                M(f"{script}.py: error: ") + ".*" + match, xfail=xfail, before=PARSE)


def _positive(flag: str, value: str) -> str:
    shown = repr(value) if not value.lstrip("-").isdigit() else value
    return M(f"argument {flag}: expected a positive integer, got {shown}")


def _cases() -> list[Case]:
    out = []
    gpt = "train_gpt"
    for flag in ("--steps", "--batch-size", "--block-size", "--n-layer", "--n-head", "--n-embd", "--eval-every",
                 "--eval-batches", "--microbatches"):
        out.append(_flag(gpt, (flag, "0"), _positive(flag, "0")))
    out.append(_flag(gpt, ("--steps", "-3"), _positive("--steps", "-3")))
    out.append(_flag(gpt, ("--steps", "ten"), _positive("--steps", "ten")))
    for flag, value in (("--warmup", "-1"), ("--save-every", "-1"), ("--check", "-2"), ("--sample", "-5")):
        out.append(_flag(gpt, (flag, value), M(f"argument {flag}: expected an integer >= 0, got {value}")))
    for flag, value in (("--lr", "-0.001"), ("--weight-decay", "-0.1"), ("--grad-clip", "-1")):
        out.append(_flag(gpt, (flag, value), M(f"argument {flag}: expected a finite number >= 0, got {float(value)}")))
    for flag, value in (("--lr", "nan"), ("--grad-clip", "inf")):
        out.append(_flag(gpt, (flag, value), M(f"argument {flag}: expected a finite number >= 0, got {float(value)} (not finite)")))
    for value in ("1.0", "-0.1", "2"):
        out.append(_flag(gpt, ("--dropout", value), M(f"argument --dropout: expected a probability in [0, 1), got {float(value)}")))
    out.append(_flag(gpt, ("--zero-stage", "5"), M("argument --zero-stage: invalid choice: 5")))
    out.append(_flag(gpt, ("--schedule", "zb"), M("argument --schedule: invalid choice: 'zb'")))
    for value, match in (("dp=2,dp=2", "'dp=2,dp=2': axis 'dp' is given twice"), ("dp", "'dp': 'dp' is not axis=size"),
                         ("dp=0", "axis 'dp' has size '0'; every size must be an integer >= 1"),
                         ("dp=-1", "axis 'dp' has size '-1'"), ("dp=two", "axis 'dp' has size 'two'"),
                         ("d-p=2", "axis name 'd-p' is not an identifier"), ("=2", "'=2' is not axis=size"),
                         ("dp=2,", "'' is not axis=size")):
        out.append(_flag(gpt, ("--mesh", value), M("argument --mesh: ", match)))
    out.append(_flag(gpt, ("--eval-only",), M("--eval-only evaluates a trained model: it needs --resume CHECKPOINT")))
    out.append(_flag(gpt, ("--save-every", "10"), M("--save-every 10 needs --ckpt-dir DIR")))
    out.append(_flag(gpt, ("--batch-size", "3"), M("--batch-size 3 must be divisible by the data axes ['dp'] of the mesh {'dp': 2} (2 ranks)")))
    out.append(_flag(gpt, ("--mesh", "pp=2", "--batch-size", "16", "--microbatches", "3"),
                     M("--microbatches 3 must divide the batch of each data rank", "--batch-size 16 over 1 data rank(s)", "{'pp': 2}", "16 rows")))
    out.append(_flag(gpt, ("--mesh", "pp=2,dp=1", "--batch-size", "6", "--microbatches", "4"), M("--microbatches 4 must divide", "6 rows")))
    out.append(_flag(gpt, ("--n-embd", "30", "--n-head", "4"), M("--n-embd 30 must be divisible by --n-head 4")))

    hf = "train_hf"
    for flag in ("--steps", "--batch-size", "--block-size", "--hidden", "--layers", "--heads", "--eval-every"):
        out.append(_flag(hf, (flag, "0"), _positive(flag, "0")))
    out.append(_flag(hf, ("--lr", "-1"), M("argument --lr: expected a finite number >= 0, got -1.0")))
    out.append(_flag(hf, ("--zero-stage", "5"), M("argument --zero-stage: invalid choice: 5")))
    out.append(_flag(hf, ("--model", "bert"), M("argument --model: invalid choice: 'bert'")))
    out.append(_flag(hf, ("--mesh", "dp=2,dp=2"), M("argument --mesh: 'dp=2,dp=2': axis 'dp' is given twice")))
    out.append(_flag(hf, ("--mesh", "dp"), M("argument --mesh: 'dp': 'dp' is not axis=size")))
    out.append(_flag(hf, ("--mesh", "tp=x"), M("argument --mesh: 'tp=x': axis 'tp' has size 'x'")))
    # pp used to be refused outright ("this script has no pipeline path"); now HF pipelines train
    # (tests/test_examples.py), and only what they cannot do is refused, at parse time
    out.append(_flag(hf, ("--mesh", "pp=2,tp=2", "--sequence-parallel"),
                     M("--sequence-parallel with pp=2 in --mesh {'pp': 2, 'tp': 2}: a Hugging Face model's pipeline "
                       "layers build masks and rotary positions", "Fix: drop --sequence-parallel")))
    for model in _without_pipeline_layers():
        out.append(_flag(hf, ("--model", model, "--mesh", "pp=2"),
                         M(f"--model {model} with pp=2 in --mesh {{'pp': 2}}: shardlib has no pipeline layers for "
                           f"{model}", "Fix: another --model, or a mesh without pp")))
    out.append(_flag(hf, ("--mesh", "pp=2", "--batch-size", "6", "--microbatches", "4"),
                     M("--microbatches 4 must divide the batch of each data rank: --batch-size 6 over 1 data rank(s) "
                       "of the mesh {'pp': 2} is 6 rows")))
    out.append(_flag(hf, ("--model", "qwen3", "--mesh", "tp=4", "--heads", "4"),
                     M("--heads 4 gives --model qwen3 2 key/value heads (heads / 2), which tp=4 of --mesh {'tp': 4} "
                       "does not divide", "Fix: --heads a multiple of 8")))
    out.append(_flag(hf, ("--model", "mixtral", "--mesh", "dp=1,tp=2", "--heads", "3", "--hidden", "96"),
                     M("--heads 3 gives --model mixtral 3 key/value heads (as many as heads, --heads being odd)",
                       "Fix: --heads a multiple of 4")))
    out.append(_flag(hf, ("--model", "gpt2", "--mesh", "tp=4", "--heads", "2"),
                     M("--heads 2 gives --model gpt2 2 key/value heads (one per head), which tp=4", "a multiple of 4")))
    out.append(_flag(hf, ("--hidden", "130", "--heads", "4"), M("--hidden 130 must be divisible by --heads 4")))
    out.append(_flag(hf, ("--batch-size", "5"), M("--batch-size 5 must be divisible by the data axes ['dp']")))
    return out


HF_MODELS = ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "mixtral", "phi", "phi3", "gpt_neox", "opt", "gpt2")
"""train_hf.py's --model choices."""


def _without_pipeline_layers() -> list[str]:
    """train_hf's families that shardlib has no Hugging Face pipeline layers for (Mixtral and Phi
    at the time of writing; a family that gains them drops out of the refusal cases)."""
    from shardlib.models.hf import HF_PIPELINE_FAMILIES

    return sorted(set(HF_MODELS) - set(HF_PIPELINE_FAMILIES))


CASES = _cases()
