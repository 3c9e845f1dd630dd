"""The standard clients, used as a new user would, on relational checkpoints (tests/client_models.py: an exact
conversion of a tiny random Llama, and that conversion compressed with per-layer widths):

- Transformers' `pipeline("text-generation")`, with the plugin imported and with `trust_remote_code=True` alone in
  a process that cannot import relational_hf: greedy text (and token ids) of the exact conversion are the Llama
  source's, those of the compressed checkpoint are its `generate()`'s;
- EleutherAI's lm-evaluation-harness (`lm_eval`, the `hf` model with `pretrained=<folder>,trust_remote_code=True`)
  on a local rolling-loglikelihood task: word and byte perplexity of the exact conversion are the Llama source's
  to 1e-4 relative;
- TRL's `SFTTrainer` with a PEFT `LoraConfig`: a few steps on an in-memory dataset lower the loss and change the
  weights; merged, saved and reloaded with `AutoModelForCausalLM`, the model gives the merged model's logits, which
  are the adapter model's.

lm-eval and TRL come with the `clients` extra (`pip install -e ".[clients]"`); their tests skip, naming it, where
the package is missing. Nothing reaches the network: the task's documents are a local JSON-lines file."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from client_models import VOCAB, build_checkpoints, per_layer_widths
from transformers import AutoModelForCausalLM, AutoTokenizer, pipeline

PROMPTS = ["The relational model", "Once upon a time, "]
NEW_TOKENS = 12
CLIENTS_EXTRA = 'the clients extra: pip install -e ".[clients]"'


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict:
    built = build_checkpoints(tmp_path_factory.mktemp("clients"))
    widths = per_layer_widths(built["models"]["compressed"])
    # the premise of the compressed cases: widths that differ from layer to layer, QK narrower than values somewhere
    assert len(set(widths)) == len(widths) and any(qk != v for qk, v, _ in widths), widths
    return built


@torch.no_grad()
def greedy_ids(model, tokenizer) -> list[list[int]]:
    """Greedy continuations of PROMPTS by `model.generate` (prompt + NEW_TOKENS new ids, or fewer at EOS)."""
    out = []
    for prompt in PROMPTS:
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        out.append(model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False)[0].tolist())
    return out


def pipeline_outputs(pipe) -> dict:
    """The text-generation pipeline's greedy texts and token ids for PROMPTS."""
    texts = [r[0]["generated_text"] for r in pipe(PROMPTS, max_new_tokens=NEW_TOKENS, do_sample=False)]
    ids = [
        r[0]["generated_token_ids"]
        for r in pipe(PROMPTS, max_new_tokens=NEW_TOKENS, do_sample=False, return_tensors=True)
    ]
    return {"texts": texts, "ids": [list(map(int, x)) for x in ids]}


@pytest.fixture(scope="module")
def expected(checkpoints) -> dict:
    """What the pipelines must give: the Llama source through the same pipeline (exact) and the compressed model's
    own generate() (compressed); the source's ids are also checked against its generate()."""
    paths, models = checkpoints["paths"], checkpoints["models"]
    tokenizer = AutoTokenizer.from_pretrained(paths["llama"])
    llama = pipeline_outputs(pipeline("text-generation", model=str(paths["llama"]), device="cpu"))
    assert llama["ids"] == greedy_ids(models["llama"], tokenizer)
    # the premise of comparing greedy choices: along the source's continuations, each chosen token leads the next by
    # 100 times more than the conversion's rounding (about 1e-6 of the logit scale)
    for prompt, ids in zip(PROMPTS, llama["ids"]):
        with torch.no_grad():
            logits = models["llama"](torch.tensor([ids])).logits[0, len(tokenizer(prompt).input_ids) - 1 : -1]
        top = logits.topk(2, dim=-1).values
        assert (top[:, 0] - top[:, 1]).min().item() > 1e-4 * logits.abs().max().item()
    compressed_ids = greedy_ids(models["compressed"], tokenizer)
    return {
        "exact": llama,
        "compressed": {"ids": compressed_ids, "texts": tokenizer.batch_decode(compressed_ids)},
    }


@pytest.mark.parametrize("kind", ["exact", "compressed"])
def test_text_generation_pipeline_with_the_plugin(checkpoints, expected, kind):
    """With relational_hf imported, `pipeline("text-generation", model=folder)` loads the relational class and
    continues greedily as the source Llama does (exact conversion) or as the model's generate() (compressed)."""
    pipe = pipeline("text-generation", model=str(checkpoints["paths"][kind]), device="cpu")
    assert type(pipe.model).__name__ == "RelationalForCausalLM"
    got = pipeline_outputs(pipe)
    assert got["ids"] == expected[kind]["ids"]
    assert got["texts"] == expected[kind]["texts"]
    assert all(len(ids) > len(PROMPTS[0].encode()) for ids in got["ids"])  # something was generated


def test_text_generation_pipeline_with_trust_remote_code_alone(checkpoints, expected, tmp_path):
    """In a process where relational_hf cannot be imported, `pipeline(..., trust_remote_code=True)` loads the code
    files written next to each checkpoint and gives the same greedy texts and ids as above."""
    paths = {k: str(checkpoints["paths"][k]) for k in ("exact", "compressed")}
    script = textwrap.dedent(f"""
        import json, sys
        sys.modules["relational_hf"] = None  # the plugin must not be importable here
        import torch
        from transformers import pipeline
        torch.set_num_threads({torch.get_num_threads()})
        out = {{}}
        for kind, path in {paths!r}.items():
            pipe = pipeline("text-generation", model=path, device="cpu", trust_remote_code=True)
            assert not type(pipe.model).__module__.startswith("relational_hf"), type(pipe.model).__module__
            run = lambda **kw: pipe({PROMPTS!r}, max_new_tokens={NEW_TOKENS}, do_sample=False, **kw)
            out[kind] = {{
                "texts": [r[0]["generated_text"] for r in run()],
                "ids": [[int(i) for i in r[0]["generated_token_ids"]] for r in run(return_tensors=True)],
                "module": type(pipe.model).__module__,
            }}
        print("RESULT" + json.dumps(out))
    """)
    env = dict(os.environ, HF_MODULES_CACHE=str(tmp_path / "modules"), HF_HUB_OFFLINE="1")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.split("RESULT")[-1])
    for kind in ("exact", "compressed"):
        assert got[kind]["module"].startswith("transformers_modules"), got[kind]["module"]
        assert got[kind]["ids"] == expected[kind]["ids"], kind
        assert got[kind]["texts"] == expected[kind]["texts"], kind


# ---------------------------------------------------------------------------------------------------------------
# lm-evaluation-harness

#: the documents of the local task: long enough (in bytes, one token each) for several rolling windows of the
#: checkpoints' 128 positions
DOCUMENTS = [
    "The quick brown fox jumps over the lazy dog, and the dog does not mind. " * 3,
    "Relational models keep what attention needs: the products of query and key maps, of value and output maps.",
    "A third document, longer than the second, with numbers 12345 and punctuation; it ends here. " * 4,
]

TASK = """\
task: tiny_rolling
dataset_path: json
dataset_kwargs:
  data_files:
    test: {documents}
  cache_dir: {cache}
test_split: test
output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{{{text}}}}"
metric_list:
  - metric: word_perplexity
  - metric: byte_perplexity
  - metric: bits_per_byte
metadata:
  version: 1.0
"""


def test_lm_eval_scores_the_exact_conversion_like_its_source(checkpoints, tmp_path, monkeypatch):
    """lm-eval's `hf` model with `pretrained=<folder>,trust_remote_code=True` on a local rolling-loglikelihood task
    (TaskManager include_path): the exact conversion's word and byte perplexity equal the Llama source's to 1e-4
    relative."""
    lm_eval = pytest.importorskip("lm_eval", reason=f"lm-evaluation-harness is not installed ({CLIENTS_EXTRA})")
    from lm_eval.api.registry import get_model
    from lm_eval.tasks import TaskManager

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "documents.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in DOCUMENTS))
    (tasks / "tiny_rolling.yaml").write_text(
        TASK.format(documents=tasks / "documents.jsonl", cache=tmp_path / "datasets_cache")
    )
    manager = TaskManager(include_path=str(tasks), include_defaults=False)
    scores, classes = {}, {}
    for kind in ("llama", "exact"):
        lm = get_model("hf").create_from_arg_string(
            f"pretrained={checkpoints['paths'][kind]},trust_remote_code=True,dtype=float32",
            {"batch_size": 1, "device": "cpu"},
        )
        classes[kind] = type(lm.model).__name__
        out = lm_eval.simple_evaluate(
            model=lm, tasks=["tiny_rolling"], task_manager=manager, bootstrap_iters=0, log_samples=False
        )
        scores[kind] = out["results"]["tiny_rolling"]
    assert classes == {"llama": "LlamaForCausalLM", "exact": "RelationalForCausalLM"}
    assert scores["exact"]["sample_len"] == len(DOCUMENTS)
    for metric in ("word_perplexity,none", "byte_perplexity,none"):
        ref, got = scores["llama"][metric], scores["exact"][metric]
        assert 1.0 < ref < float("inf"), (metric, ref)
        assert abs(got - ref) <= 1e-4 * ref, (metric, got, ref)


# ---------------------------------------------------------------------------------------------------------------
# TRL SFTTrainer + PEFT LoRA

SFT_TEXTS = ["abcabcabc abcabc", "abc abc abc abc", "cab cab cabcab", "bca bcabca bca"] * 4


@torch.no_grad()
def _logits(model, ids: torch.Tensor) -> torch.Tensor:
    return model.eval()(input_ids=ids).logits


@pytest.mark.parametrize(
    "kind,targets",
    [("exact", "all-linear"), ("exact", "relational"), ("compressed", "all-linear")],
)
def test_trl_sft_with_lora_trains_merges_and_reloads(checkpoints, tmp_path, kind, targets):
    """TRL's SFTTrainer with a PEFT LoraConfig (TRL's usual target_modules="all-linear", or the plugin's
    relational_lora_config, which also adapts the gauge-fixed maps of the pivot gauge) fine-tunes a relational
    checkpoint: the logged loss goes down and the merged weights differ from the base; merge_and_unload gives the
    adapter model's logits, and the merged model saved and reloaded with AutoModelForCausalLM gives them again."""
    pytest.importorskip("trl", reason=f"TRL is not installed ({CLIENTS_EXTRA})")
    from datasets import Dataset
    from peft import LoraConfig
    from trl import SFTConfig, SFTTrainer

    from relational_hf.training.peft_support import relational_lora_config

    path = checkpoints["paths"][kind]
    model = AutoModelForCausalLM.from_pretrained(path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    base = {k: v.clone() for k, v in model.state_dict().items()}
    if targets == "all-linear":
        lora = LoraConfig(r=4, lora_alpha=16, target_modules="all-linear", task_type="CAUSAL_LM")
    else:
        lora = relational_lora_config(r=4, lora_alpha=16, task_type="CAUSAL_LM")
    args = SFTConfig(
        output_dir=str(tmp_path / "run"), max_steps=8, per_device_train_batch_size=4, learning_rate=5e-3,
        logging_steps=1, save_strategy="no", report_to=[], use_cpu=True, disable_tqdm=True, max_length=32, seed=0,
        bf16=False,
    )  # fmt: skip
    # bf16=False: TRL's default (True) trains under bf16 autocast, and Accelerate leaves the trained model's forward
    # wrapped in it, so the adapter model's logits would be bf16-rounded; in fp32 the comparisons below are exact
    dataset = Dataset.from_dict({"text": SFT_TEXTS})
    trainer = SFTTrainer(model=model, args=args, train_dataset=dataset, processing_class=tokenizer, peft_config=lora)
    adapted = {n.split(".")[-1] for n, m in trainer.model.named_modules() if hasattr(m, "lora_A")}
    if targets == "relational" or kind == "compressed":  # the free gauge: every map a plain Linear
        assert {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"} <= adapted, adapted
    else:
        assert {"q_proj", "o_proj", "gate_proj", "down_proj"} <= adapted, adapted
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(losses) == 8 and losses[-1] < losses[0], losses

    ids = torch.randint(3, VOCAB, (2, 20), generator=torch.Generator().manual_seed(1))
    adapter_logits = _logits(trainer.model, ids)
    merged = trainer.model.merge_and_unload()
    merged_logits = _logits(merged, ids)
    scale = merged_logits.abs().max().item()
    assert (merged_logits - adapter_logits).abs().max().item() <= 1e-5 * scale
    changed = max((v - base[k]).abs().max().item() for k, v in merged.state_dict().items() if k in base)
    assert changed > 1e-4, changed
    merged.save_pretrained(tmp_path / "merged")
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    assert type(reloaded).__name__ == "RelationalForCausalLM"
    assert (_logits(reloaded, ids) - merged_logits).abs().max().item() <= 1e-5 * scale
