"""Training configs: a Python file of sections, loaded into a checked attribute dict.

HAI-LLM's configs are Python files; torchtitan's are TOML with ``--section.key=value``
overrides. A shardlib config is a Python file that assigns its sections as dicts (or
:class:`Config`); only these names are read, in its own namespace (never into ours)::

    parallel = dict(mesh={"dp": 2}, zero_stage=3, activation_checkpointing="full")
    model = dict(builder="gpt", n_layer=6, n_head=6, n_embd=384, block_size=256)
    optim = dict(lr=3e-4, warmup_steps=100, decay="cosine")
    train = dict(steps=1000, global_batch=32)

:func:`load_config` fills every key left out with its default (:data:`SCHEMA`), applies
overrides written ``"train.steps=100"`` (the value read as a Python literal, else as a string),
and refuses an unknown section or key, or a value of the wrong type, naming the key path and
where it came from (the file, or the override). The ``model`` section's keys beyond ``builder``
are the builder's: for ``builder="gpt"`` the fields of :class:`shardlib.models.GPTConfig`; for
``"llama"`` and ``"palm"`` those of :class:`shardlib.models.LlamaConfig` (PaLM: one key/value
head and tied embeddings by default; its block is always parallel); for ``"hf"`` a Hugging Face
family and its sizes, or a local ``pretrained`` folder (:mod:`shardlib.models.hf_build`).
"""

from __future__ import annotations

import ast
import dataclasses
import os
import runpy
from typing import Any, Iterable

__all__ = ["Config", "ConfigError", "SCHEMA", "BUILDERS", "load_config"]


class ConfigError(ValueError):
    """A config that cannot be used: an unknown section or key, a value of the wrong type, a
    malformed override, a missing file. The message names the key path and its source."""


class Config(dict):
    """A dict whose keys are also attributes (``cfg.train.steps``); nested dicts are Configs.

    Raises:
        AttributeError: reading a key that is not there (naming the keys that are).
    """

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        for k, v in self.items():
            if isinstance(v, dict) and not isinstance(v, Config) and k != "mesh":
                self[k] = Config(v)

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError:
            raise AttributeError(f"config has no key {name!r} (keys: {', '.join(self)})") from None

    def __setattr__(self, name: str, value: Any) -> None:
        self[name] = value

    def to_dict(self) -> dict:
        """Plain nested dicts (for JSON, logs and checkpoints)."""
        return {k: v.to_dict() if isinstance(v, Config) else v for k, v in self.items()}


_NUM = (int, float)
# section -> key -> (accepted types, default). None in the types: the key may be None.
SCHEMA: dict[str, dict[str, tuple[tuple, Any]]] = {
    "parallel": {
        "mesh": ((dict,), {"dp": 1}), "zero_stage": ((int,), 0), "data_axes": ((tuple, list, type(None)), None),
        "sequence_parallel": ((bool,), False), "schedule": ((str, type(None)), None), "microbatches": ((int,), 1),
        "virtual_stages": ((int, type(None)), None), "activation_checkpointing": ((str, int, bool, type(None)), None),
        "offload_ratio": ((*_NUM, type(None)), None), "optimizer_offload": ((bool,), False),
        "offload_param_frac": (_NUM, 0.0),
    },
    "model": {"builder": ((str,), "gpt")},
    "optim": {
        "name": ((str,), "adamw"), "lr": (_NUM, 3e-4), "min_lr": (_NUM, 0.0), "weight_decay": (_NUM, 0.1),
        "betas": ((tuple, list), (0.9, 0.95)), "warmup_steps": ((int,), 0), "decay": ((str,), "cosine"),
        "grad_clip": ((*_NUM, type(None)), 1.0),
    },
    "data": {
        "source": ((str,), "embedded"), "files": ((tuple, list), ()), "tokenizer": ((str,), "bytes"),
        "val_files": ((tuple, list), ()), "val_fraction": (_NUM, 0.1), "vocab_size": ((int,), 4096),
        "cache_dir": ((str, type(None)), None),
    },
    "train": {
        "steps": ((int,), 100), "global_batch": ((int,), 8), "seq_len": ((int,), 64), "grad_accum": ((int,), 1),
        "param_dtype": ((str, type(None)), None), "eval_interval": ((int,), 0), "eval_steps": ((int,), 4),
        "log_interval": ((int,), 10), "seed": ((int,), 0), "out_dir": ((str, type(None)), None),
        "tensorboard": ((bool,), True), "peak_tflops": ((*_NUM, type(None)), None),
    },
    "checkpoint": {
        "dir": ((str, type(None)), None), "interval": ((int,), 0), "keep_last": ((int,), 2), "resume": ((bool,), False),
    },
}


def _fields(config_cls: type, **defaults: Any) -> dict[str, tuple[tuple, Any]]:
    out = {}
    for f in dataclasses.fields(config_cls):
        kind = {"int": (int,), "float": _NUM, "bool": (bool,)}.get(str(f.type), (object,))
        out[f.name] = (kind, defaults.get(f.name, f.default))
    return out


def _gpt_fields() -> dict[str, tuple[tuple, Any]]:
    from .models import GPTConfig

    return _fields(GPTConfig)


def _llama_fields() -> dict[str, tuple[tuple, Any]]:
    from .models import LlamaConfig

    return {k: v for k, v in _fields(LlamaConfig).items() if k != "parallel_block"}


def _palm_fields() -> dict[str, tuple[tuple, Any]]:
    from .models import LlamaConfig

    fields = _fields(LlamaConfig, n_kv_head=1, tie_embeddings=True)
    return {k: v for k, v in fields.items() if k != "parallel_block"}


def _hf_fields() -> dict[str, tuple[tuple, Any]]:
    """An unmodified Hugging Face causal LM (shardlib.models.hf_build): a family at these sizes,
    randomly initialized, or ``pretrained``: a local folder with config.json and weights."""
    return {"family": ((str,), "llama"), "hidden": ((int,), 128), "layers": ((int,), 4), "heads": ((int,), 4),
            "n_kv_heads": ((int,), 0), "vocab_size": ((int,), 256), "block_size": ((int,), 128), "dropout": (_NUM, 0.0),
            "pretrained": ((str, type(None)), None)}


# model builders: name -> the model section's keys beyond "builder" (types and defaults):
# gpt: shardlib.models.GPTConfig; llama: LlamaConfig; palm: LlamaConfig with PaLM's defaults;
# hf: a Hugging Face family (shardlib.models.hf_build)
BUILDERS = {"gpt": _gpt_fields, "llama": _llama_fields, "palm": _palm_fields, "hf": _hf_fields}


def _type_ok(value: Any, kinds: tuple) -> bool:
    if isinstance(value, bool) and bool not in kinds:  # True is an int to Python, not to a config
        return False
    return object in kinds or isinstance(value, kinds)


def _kind_names(kinds: tuple) -> str:
    return " or ".join("None" if k is type(None) else k.__name__ for k in kinds)


def _check(section: str, key: str, value: Any, source: str, schema: dict) -> None:
    if key not in schema:
        raise ConfigError(f"config key '{section}.{key}' ({source}) is unknown; the keys of '{section}' are: "
                          f"{', '.join(sorted(schema))}")
    kinds = schema[key][0]
    if not _type_ok(value, kinds):
        raise ConfigError(f"config key '{section}.{key}' ({source}) must be {_kind_names(kinds)}, got "
                          f"{type(value).__name__} {value!r}")


def _section_schema(section: str, values: dict, source: str) -> dict:
    schema = dict(SCHEMA[section])
    if section == "model":
        builder = values.get("builder", schema["builder"][1])
        if builder not in BUILDERS:
            raise ConfigError(f"config key 'model.builder' ({source}) is {builder!r}; the builders are: "
                              f"{', '.join(sorted(BUILDERS))}")
        schema.update(BUILDERS[builder]())
    return schema


def _parse_override(text: str) -> tuple[str, str, Any]:
    if not isinstance(text, str) or "=" not in text or "." not in text.split("=", 1)[0]:
        raise ConfigError(f"override {text!r} must be written section.key=value (e.g. train.steps=100)")
    path, raw = text.split("=", 1)
    section, key = path.strip().split(".", 1)
    try:
        value = ast.literal_eval(raw.strip())
    except (ValueError, SyntaxError):
        value = raw.strip()  # a bare word: a string
    return section, key, value


def load_config(path: str | os.PathLike | None, overrides: Iterable[str] = ()) -> Config:
    """The config in the Python file ``path`` (None: every default), with ``overrides``.

    Args:
        path: a ``.py`` file assigning some of the sections of :data:`SCHEMA` as dicts.
        overrides: ``"section.key=value"`` strings, applied in order after the file.

    Returns:
        A :class:`Config` with every section and key (defaults filled in).

    Raises:
        ConfigError: a missing file, a file that raises, a top-level name that is not a section
            (names starting with ``_`` and modules are ignored), an unknown key, a value of the
            wrong type, an unknown model builder, a malformed override; each naming the key
            path and its source.
    """
    sections: dict[str, dict] = {name: {} for name in SCHEMA}
    sources: dict[tuple[str, str], str] = {}
    if path is not None:
        path = os.fspath(path)
        if not os.path.isfile(path):
            raise ConfigError(f"config file {path!r} does not exist")
        try:
            namespace = runpy.run_path(path, run_name="shardlib_config")
        except Exception as exc:  # noqa: BLE001 - the user's file: name it
            raise ConfigError(f"config file {path!r} raised {type(exc).__name__}: {exc}") from exc
        for name, value in namespace.items():
            if name.startswith("_") or type(value).__name__ == "module" or callable(value):
                continue
            if name not in SCHEMA:
                raise ConfigError(f"config file {path!r} assigns {name!r}, which is not a section; the sections are: "
                                  f"{', '.join(SCHEMA)} (names starting with _ are private)")
            if not isinstance(value, dict):
                raise ConfigError(f"config section {name!r} ({path}) must be a dict, got {type(value).__name__}")
            sections[name].update(value)
            sources.update({(name, k): f"from {path}" for k in value})
    for text in overrides:
        section, key, value = _parse_override(text)
        if section not in SCHEMA:
            raise ConfigError(f"override {text!r} names section {section!r}; the sections are: {', '.join(SCHEMA)}")
        sections[section][key] = value
        sources[(section, key)] = f"override {text!r}"
    out = {}
    for section, values in sections.items():
        schema = _section_schema(section, values, sources.get((section, "builder"), "default"))
        for key, value in values.items():
            _check(section, key, value, sources.get((section, key), "default"), schema)
        out[section] = {**{k: d for k, (_, d) in schema.items()}, **values}
    return Config(out)
