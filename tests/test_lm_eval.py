"""lm-eval on a sharded model: ShardedLM's log-likelihoods equal a single-process model's, and the
harness's scores on small local multiple-choice sets in HellaSwag, PIQA and WinoGrande format
(written here; the harness reads them as local JSON, no download) equal the scores computed by
hand from the single-process model."""

import json
import math
import os

import pytest
import torch

pytest.importorskip("lm_eval", reason="lm-eval is not installed (pip install lm-eval)")

from shardlib.config import load_config  # noqa: E402
from shardlib.testing import run_on  # noqa: E402

HELLASWAG = [
    dict(activity_label="Cooking", ctx_a="A man cracks two eggs into a bowl.", ctx_b="he",
         endings=["whisks them with a fork.", "paints the ceiling blue.", "def main(): return 0", "swims away."], label=0),
    dict(activity_label="Sports", ctx_a="The player dribbles down the court.", ctx_b="she",
         endings=["import os", "shoots and scores.", "bakes a cake in the oven for an hour.", "sleeps."], label=1),
    dict(activity_label="Python", ctx_a="The function opens the file.", ctx_b="it",
         endings=["reads each line and returns them.", "x", "flies to the moon with wings of wax.", "for i in range"],
         label=0),
]
PIQA = [
    dict(goal="How do you boil water?", sol1="Put it in a pot on the stove.", sol2="Put it in the freezer.", label=0),
    dict(goal="How to open a jar?", sol1="Hit it with a fish.", sol2="Twist the lid counterclockwise.", label=1),
    dict(goal="def add(a, b):", sol1="    return a + b", sol2="zebra zebra zebra", label=0),
]
WINOGRANDE = [
    dict(sentence="The trophy does not fit in the case because the _ is too big.", option1="trophy", option2="case",
         answer="1"),
    dict(sentence="Sarah lent Anna a book because _ had finished reading it.", option1="Sarah", option2="Anna",
         answer="1"),
]
CONFIG = ["parallel.zero_stage=3", "model.n_layer=2", "model.n_embd=64", "model.n_head=2", "model.block_size=64",
          "train.tensorboard=False", "train.seq_len=32"]


def _write_tasks(folder):
    os.makedirs(folder, exist_ok=True)
    for name, docs in (("hellaswag", HELLASWAG), ("piqa", PIQA), ("winogrande", WINOGRANDE)):
        with open(os.path.join(folder, f"{name}.jsonl"), "w") as f:
            f.writelines(json.dumps(d) + "\n" for d in docs)
    common = lambda name: (f"dataset_path: json\ndataset_kwargs:\n  data_files:\n    validation: "
                           f"{os.path.join(folder, name + '.jsonl')}\noutput_type: multiple_choice\n"
                           f"validation_split: validation\n")
    with open(os.path.join(folder, "local_hellaswag.yaml"), "w") as f:
        f.write("task: local_hellaswag\n" + common("hellaswag") +
                'doc_to_text: "{{activity_label}}: {{ctx_a}} {{ctx_b|capitalize}}"\ndoc_to_target: label\n'
                'doc_to_choice: "{{endings}}"\nmetric_list:\n  - metric: acc\n  - metric: acc_norm\n')
    with open(os.path.join(folder, "local_piqa.yaml"), "w") as f:
        f.write("task: local_piqa\n" + common("piqa") + 'doc_to_text: "Question: {{goal}}\\nAnswer:"\n'
                'doc_to_target: label\ndoc_to_choice: "{{[sol1, sol2]}}"\nmetric_list:\n  - metric: acc\n'
                '  - metric: acc_norm\n')
    with open(os.path.join(folder, "local_winogrande.yaml"), "w") as f:
        f.write("task: local_winogrande\n" + common("winogrande") +
                "doc_to_text: !function wino.doc_to_text\ndoc_to_target: !function wino.doc_to_target\n"
                "doc_to_choice: !function wino.doc_to_choice\nmetric_list:\n  - metric: acc\n")
    with open(os.path.join(folder, "wino.py"), "w") as f:  # lm-eval's own WinoGrande preprocessing
        f.write('def doc_to_text(doc):\n    return {"1": 0, "2": 1}[doc["answer"]]\n\n'
                'def doc_to_target(doc):\n    idx = doc["sentence"].index("_") + 1\n    return doc["sentence"][idx:].strip()\n\n'
                'def doc_to_choice(doc):\n    idx = doc["sentence"].index("_")\n'
                '    return [doc["sentence"][:idx] + o for o in (doc["option1"], doc["option2"])]\n')


REQUESTS = [("The quick brown fox", " jumps over the lazy dog."), ("import", " os\n"), ("x" * 80, " overflow"),
            ("A", "B")]


def _worker(shape, folder):
    os.environ["HF_DATASETS_CACHE"] = os.path.join(folder, "hf")
    import shardlib
    from lm_eval.api.instance import Instance

    from shardlib.eval import downstream
    from shardlib.eval.harness import ByteCodec, ShardedLM
    from shardlib.train import setup

    cfg = load_config(None, [*CONFIG, f"parallel.mesh={shape!r}"])
    run = setup(cfg, log=lambda *_: None, verbose=False)
    lm = ShardedLM(run.smodel, ByteCodec(), max_length=64, batch_size=3)
    reqs = [Instance("loglikelihood", {}, r, i) for i, r in enumerate(REQUESTS)]
    ll = lm.loglikelihood(reqs, disable_tqdm=True)
    rolling = lm.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, ("def f(x):\n    return x",), 0)],
                                       disable_tqdm=True)
    # a wildcard as lm-eval's CLI takes it ('local_p*': local_piqa); it passed the name check, then lm-eval's
    # simple_evaluate raised KeyError on every rank (new-user pass)
    scores = downstream(run, ["local_hellaswag", "local_p*", "local_winogrande"], include_path=folder, batch_size=4,
                        include_defaults=False)
    import warnings

    with warnings.catch_warnings(record=True) as caught:  # a continuation longer than the model's positions
        warnings.simplefilter("always")
        long = lm.loglikelihood([Instance("loglikelihood", {}, ("a", "b" * 70), 0)], disable_tqdm=True)
    return ll, rolling, scores, shardlib.full_state_dict(run.smodel), (long[0][0], [str(w.message) for w in caught])


def _reference_ll(model, context: str, continuation: str) -> float:
    """log p(continuation | context) by hand: one forward of the whole byte sequence."""
    ctx, cont = list(context.encode()), list(continuation.encode())
    ids = (ctx + cont)[-65:]
    x = torch.tensor([ids[:-1]])
    logp = torch.log_softmax(model(x)[0][0].double(), -1)
    n = len(cont)
    return sum(logp[len(ids) - 1 - n + j, cont[j]].item() for j in range(n))


def _hand_scores(model):
    """acc and acc_norm as lm-eval defines them: the argmax of the choices' log-likelihoods
    (acc_norm: divided by the choice's length in characters), against the gold index."""
    def mc(docs, text, choices, gold):
        acc = norm = 0
        for d in docs:
            lls = [_reference_ll(model, text(d), " " + c) for c in choices(d)]
            acc += max(range(len(lls)), key=lls.__getitem__) == gold(d)
            norm += max(range(len(lls)), key=lambda i: lls[i] / len(choices(d)[i])) == gold(d)
        return acc / len(docs), norm / len(docs)

    hs = mc(HELLASWAG, lambda d: f"{d['activity_label']}: {d['ctx_a']} {d['ctx_b'].capitalize()}",
            lambda d: d["endings"], lambda d: d["label"])
    pq = mc(PIQA, lambda d: f"Question: {d['goal']}\nAnswer:", lambda d: [d["sol1"], d["sol2"]], lambda d: d["label"])
    wino = 0
    for d in WINOGRANDE:
        i = d["sentence"].index("_")
        rest = " " + d["sentence"][i + 1:].strip()
        lls = [_reference_ll(model, d["sentence"][:i] + o, rest) for o in (d["option1"], d["option2"])]
        wino += (lls[1] > lls[0]) == (d["answer"] == "2")
    return {"local_hellaswag": hs, "local_piqa": pq, "local_winogrande": (wino / len(WINOGRANDE), None)}


@pytest.mark.multiprocess
def test_lm_eval_scores_of_a_sharded_model_equal_the_hand_computed_ones(tmp_path):
    """On dp=2 x tp=2 under ZeRO-3: the tensor-parallel ranks need identical inputs, the data
    ranks repeat the work; every rank runs the same batches."""
    from shardlib.models import GPT, GPTConfig

    folder = str(tmp_path / "tasks")
    _write_tasks(folder)
    ll, rolling, scores, state, (long, warned) = run_on(4, _worker, {"dp": 2, "tp": 2}, folder)[0]
    model = GPT(GPTConfig(n_layer=2, n_embd=64, n_head=2, block_size=64))
    model.load_state_dict(state, strict=False)
    model.eval()
    with torch.no_grad():
        for (got, greedy), (ctx, cont) in zip(ll, REQUESTS):
            # the sharded fp32 forward (padded batches) against one unpadded forward: measured 8.0e-8
            # relative on tp=2, 3.8e-8 on dp=2; 1e-6 is over ten times that
            assert got == pytest.approx(_reference_ll(model, ctx, cont), rel=1e-6)
            assert isinstance(greedy, bool)
        text = "def f(x):\n    return x"
        assert rolling[0] == pytest.approx(_reference_ll(model, "\n", text), rel=1e-6)  # on end-of-text; 7.4e-9 measured
        hand = _hand_scores(model)
        # 70 continuation tokens, 64 positions: the last 64 are scored (given the one before), and said so
        assert long == pytest.approx(_reference_ll(model, "b", "b" * 64), rel=1e-6)
        assert warned == ["ShardedLM: a continuation of 70 tokens is longer than max_length (64): only its last 64 "
                          "tokens are scored"]
    assert scores["local_hellaswag"]["acc,none"] == hand["local_hellaswag"][0]
    assert scores["local_hellaswag"]["acc_norm,none"] == hand["local_hellaswag"][1]
    assert scores["local_piqa"]["acc,none"] == hand["local_piqa"][0]
    assert scores["local_piqa"]["acc_norm,none"] == hand["local_piqa"][1]
    assert scores["local_winogrande"]["acc,none"] == hand["local_winogrande"][0]
    assert not math.isnan(scores["local_piqa"]["acc,none"])


def test_an_unknown_task_is_refused_before_the_checkpoint_is_loaded(tmp_path):
    """`shardlib.eval --tasks hellaswagg` loaded the checkpoint, computed its validation loss, then
    ended in lm-eval's KeyError traceback from one rank (new-user pass, 65-90 s): the names are now
    checked first, with the close ones named, as one usage line (exit status 2)."""
    from shardlib.eval import main, task_manager

    folder = str(tmp_path / "tasks")
    _write_tasks(folder)
    with pytest.raises(ValueError, match=r"unknown lm-eval task 'local_piqaa': not among the tasks of '[^']*tasks'; "
                                         r"close: local_piqa(, [a-z_]+)*\. Fix"):
        task_manager(["local_hellaswag", "local_piqaa"], folder, include_defaults=False)
    assert task_manager(["local_*"], folder, include_defaults=False).match_tasks(["local_*"])  # wildcards pass
    with pytest.raises(SystemExit) as exit_:  # the checkpoint does not exist: refused before it is opened
        main(["--ckpt", str(tmp_path / "no-such-checkpoint"), "--tasks", "local_piqaa", "--include-path", folder,
              "--only-included"])
    # (shardlib's parser raises the usage line; the entry point prints it and exits with status 2)
    assert str(exit_.value.code).startswith("shardlib.eval: error: --tasks: unknown lm-eval task 'local_piqaa'")


def test_a_task_list_with_spaces_names_the_tasks(tmp_path):
    """--tasks "local_piqa, local_hellaswag" was refused as the task ' local_hellaswag' (pass G)."""
    from shardlib.eval import main

    folder = str(tmp_path / "tasks")
    _write_tasks(folder)
    with pytest.raises(Exception) as info:  # past the task check: the checkpoint does not exist
        main(["--ckpt", str(tmp_path / "none"), "--tasks", "local_piqa, local_hellaswag", "--include-path", folder,
              "--only-included"])
    assert "unknown lm-eval task" not in str(info.value)
    assert "not a checkpoint" in str(info.value) or "does not exist" in str(info.value), info.value
