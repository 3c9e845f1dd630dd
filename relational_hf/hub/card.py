"""Model cards for checkpoints published with relational-hf.

The card is a `huggingface_hub.ModelCard`: YAML metadata the Hub indexes (library, tags, license,
datasets, base model, pipeline tag, and a `model-index` built from `EvalResult`s) above a README
rendered from `templates/model_card.md`. The architecture section is read from the checkpoint's
`config.json`, so it describes relational checkpoints and plain Llama-family ones alike.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jinja2
from huggingface_hub import EvalResult, ModelCard, ModelCardData
from safetensors import safe_open

from ..modeling.modeling_gauge import GAUGE_LAYOUT_BUFFERS

TEMPLATES = jinja2.Environment(
    loader=jinja2.FileSystemLoader(Path(__file__).parent / "templates"),
    trim_blocks=True,
    lstrip_blocks=True,
    keep_trailing_newline=True,
    undefined=jinja2.StrictUndefined,
)
RELATIONAL_MODEL_TYPE = "relational-transformer"
TAGS = ("relational-hf", RELATIONAL_MODEL_TYPE)

# config.json keys shown in the architecture table, in this order, when present.
ARCHITECTURE_KEYS = (
    ("model_type", "Model type"),
    ("hidden_size", "Hidden size"),
    ("intermediate_size", "MLP width"),
    ("num_hidden_layers", "Layers"),
    ("num_attention_heads", "Attention heads"),
    ("num_key_value_heads", "Key/value heads"),
    ("head_dim", "Head dimension"),
    ("qk_rank", "QK rank"),
    ("gauge", "Gauge"),
    ("position_encoding", "Position encoding"),
    ("value_parallel_removal", "Value-space parallel removal"),
    ("vocab_size", "Vocabulary size"),
    ("max_position_embeddings", "Context length"),
    ("tie_word_embeddings", "Tied embeddings"),
    ("final_norm_gain", "Final norm gain"),
    ("dtype", "Weights dtype"),
)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


def read_config(checkpoint_dir: str | Path) -> dict[str, Any]:
    """The checkpoint's `config.json` as a dict; ValueError naming the problem if it is missing or invalid."""
    path = Path(checkpoint_dir) / "config.json"
    if not path.is_file():
        raise ValueError(f"{checkpoint_dir} has no config.json: save the model with save_pretrained() first")
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise ValueError(f"{path} is not valid JSON: {err}") from err
    if not isinstance(config, dict):
        raise ValueError(f"{path} does not hold a JSON object")
    return config


def _weight_files(folder: Path) -> list[Path]:
    """The model's safetensors files: those its shard index names, else `model.safetensors`, else every
    `*.safetensors` file of the folder (other safetensors files beside the model, such as the teacher text a healed
    compression keeps, are not weights)."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        names = set(json.loads(index.read_text(encoding="utf-8")).get("weight_map", {}).values())
        return sorted(folder / name for name in names)
    if (folder / "model.safetensors").is_file():
        return [folder / "model.safetensors"]
    return sorted(folder.glob("*.safetensors"))


def stored_parameters(checkpoint_dir: str | Path) -> int | None:
    """Number of parameter values stored in the checkpoint's weight files (`_weight_files`; tied weights count once;
    the gauge-layout buffers of pivot-gauge layers are not parameters and are left out).

    Reads only the safetensors headers (`safetensors.safe_open`: names and shapes, no tensor is loaded).
    None when the directory holds no safetensors file.
    """
    files = _weight_files(Path(checkpoint_dir))
    total = 0
    for path in files:
        with safe_open(path, framework="pt") as handle:
            total += sum(
                math.prod(handle.get_slice(name).get_shape())
                for name in handle.keys()
                if name.rsplit(".", 1)[-1] not in GAUGE_LAYOUT_BUFFERS
            )
    return total if files else None


def _architecture_rows(config: dict[str, Any], parameters: int | None) -> list[tuple[str, str]]:
    rows = [(label, _format(config[key])) for key, label in ARCHITECTURE_KEYS if key in config]
    known = {key for key, _ in ARCHITECTURE_KEYS}
    rows += [(key, _format(value)) for key, value in config.items() if "gauge" in key and key not in known]
    if parameters is not None:
        rows.append(("Stored parameters", f"{parameters:,}"))
    return rows


def _format(value: Any) -> str:
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, (dict, list)):
        return f"`{json.dumps(value)}`".replace("|", "\\|")
    return str(value).replace("|", "\\|")  # a bare | would end the markdown table cell


COMPRESSION_REPORT = "compression_report.json"


def text_name(name: Any) -> str:
    """A text's or folder's name for the card: its last path component (no path of the machine that compressed)."""
    return Path(str(name)).name.replace("|", "\\|")


def calibration_description(report: dict[str, Any]) -> str | None:
    """What a `compress` report's calibration was, in one sentence without its full stop (None when the report records
    no calibration windows): the windows, each text by name with its count, the windows the source sampled itself
    with the sampling's settings as recorded, and the file beside the model that keeps them. The one description the
    library's card and the reference cards share."""
    calibration = report.get("calibration") or {}
    windows = report.get("calibration_windows")
    if not windows:
        return None
    user, own = calibration.get("user_windows"), calibration.get("self_windows")
    sampling = calibration.get("sampling") or {}
    texts = calibration.get("texts") or {}
    if len(texts) <= 1:  # one text (or none): its name and the user's windows, as the report records them
        texts = {calibration["text"]: user} if calibration.get("text") and user is not None else {}
    text = f"{windows[0]} windows of {windows[1]} tokens"
    text += (": " + ", ".join(f"{k} of `{text_name(name)}`" for name, k in texts.items())) if texts else ""
    if own:
        text += f" and {own} sampled from the source itself" if texts else ", all sampled from the source itself (no text given)"
        text += _sampling_settings(sampling)
        # the command keeps the sampled windows beside the model, never the user's
        text += f"; the sampled windows are in `{text_name(sampling['file'])}`" if sampling.get("file") else ""
    return text


def _sampling_settings(sampling: dict[str, Any]) -> str:
    """The sampling's settings in parentheses, e.g. ` (at temperature 1, seed 1; 50% of the rows start from ...)`,
    from a report's sampling record: what it holds of them, nothing when it holds none."""
    parts = []
    if sampling.get("temperature") is not None:
        parts.append(f"at temperature {float(sampling['temperature']):g}")
    if sampling.get("seed") is not None:
        parts.append(f"seed {sampling['seed']}")
    said = ", ".join(parts)
    if sampling.get("chat_share") is not None:
        share = float(sampling["chat_share"])
        prompts = f"the '{sampling['prompts']}' prompt set" if sampling.get("prompts") else "a prompt set"
        rows = f"{share:.0%} of the rows start from a request of {prompts} in its chat template"
        said += ("; " if said else "") + rows + (", the others from one random token" if share < 1 else "")
    return f" ({said})" if said else ""


def compression_markdown(report: dict[str, Any]) -> str:
    """The card's "Compression" section from a `compress` report (`compression_report.json`): what was removed,
    the calibration text by name (the user's windows and those the source sampled itself), and, when the report
    holds them (`compress --eval`, once per text), each evaluated text's perplexity under the source and under this
    checkpoint with their ratio and the worst of them: a compression figure measured on its calibration's own kind
    of text says little about other text, so every text is shown with the source's figure beside it."""
    lines = []
    before, after = report.get("parameters_before"), report.get("parameters_after")
    what = f"Compressed with `relational-hf compress` (method `{report.get('method', 'relational')}`"
    what += f") from `{text_name(report['source'])}`" if report.get("source") else ")"
    if before and after:
        what += f": {before:,} stored parameters -> {after:,} ({1 - after / before:.1%} fewer)"
    lines.append(what + ".")
    calibration = calibration_description(report)
    if calibration:
        lines.append(f"Calibration: {calibration}.")
    heal = report.get("heal")
    if heal:
        lines.append(f"Healed {heal.get('steps', '?')} steps after the compression (the figures below are after it).")
    evaluation = (report.get("eval") or {}).get("texts") or {}
    if evaluation:
        lines += [
            "",
            "Perplexity on each text given to `--eval`, under the source and under this checkpoint:",
            "",
            "| Text | Windows (tokens) | Source | This checkpoint | Ratio |",
            "| --- | --- | --- | --- | --- |",
        ]
        for name, row in evaluation.items():
            n, t = row["windows"]
            lines.append(
                f"| `{text_name(name)}` | {n} x {t} | {row['perplexity_before']:.2f} | {row['perplexity_after']:.2f} "
                f"| x{row['ratio']:.2f} |"
            )
        worst = report["eval"].get("worst_text")
        if worst is not None and len(evaluation) > 1:
            lines += ["", f"Worst ratio: x{report['eval']['worst_ratio']:.2f} (`{text_name(worst)}`)."]
    elif report.get("eval_perplexity_before") and report.get("eval_perplexity_after"):
        b, a = report["eval_perplexity_before"], report["eval_perplexity_after"]
        lines.append(f"Held-out perplexity of `{text_name(report.get('eval_file', 'the evaluation text'))}`: "
                     f"{b:.2f} (source) -> {a:.2f} (x{a / b:.2f}); no other text was measured.")
    return "\n".join(lines)


def _compression(checkpoint_dir: Path) -> str | None:
    path = checkpoint_dir / COMPRESSION_REPORT
    if not path.is_file():
        return None
    try:
        report = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise ValueError(f"{path.name} in {checkpoint_dir} is not a readable compression report: {err}") from None
    return compression_markdown(report) if isinstance(report, dict) else None


def _eval_results(eval_results: Sequence[dict[str, Any]]) -> list[EvalResult]:
    results = []
    for index, result in enumerate(eval_results):
        try:
            results.append(EvalResult(**result))
        except TypeError as err:
            raise ValueError(f"eval_results[{index}] is not a valid EvalResult: {err}") from err
    return results


def build_model_card(
    checkpoint_dir: str | Path,
    repo_id: str,
    *,
    base_model: str | None = None,
    datasets: str | Sequence[str] | None = None,
    license: str = "apache-2.0",
    training_settings: dict[str, Any] | None = None,
    eval_results: list[dict[str, Any]] | None = None,
    parameter_table: str | None = None,
    settings_title: str = "Training",
    figures: str | None = None,
) -> ModelCard:
    """Build the model card of the checkpoint in `checkpoint_dir`, to be published as `repo_id`.

    Metadata: `library_name: transformers`, `pipeline_tag: text-generation`, the tags `relational-hf`,
    `relational-transformer` and the config's `model_type`, plus `license`, `datasets`, `base_model`
    and a `model-index` from `eval_results` (each a dict of `huggingface_hub.EvalResult` fields:
    `task_type`, `dataset_type`, `dataset_name`, `metric_type`, `metric_value`, optional others).
    Sections: an architecture summary from `config.json` (sizes, `qk_rank`, gauge, position encoding,
    value-space parallel removal, stored parameter count, whichever apply), the parameter-reduction
    table `parameter_table` (markdown, e.g. `redundancy_report(model).to_markdown()`), the training
    settings (under the heading `settings_title`, e.g. "Conversion" for a converted checkpoint), the evaluation
    results, `figures` (markdown: measurements that are not results on a dataset, e.g. perplexity on a calibration
    or a self-generated text, described there rather than posed as datasets), the compression (`compression_markdown`,
    when the folder holds the `compress` command's report: every evaluated text with the source's figure beside it),
    and how to load the model (and its tokenizer) with the plugin and without it.
    """
    checkpoint_dir = Path(checkpoint_dir)
    config = read_config(checkpoint_dir)
    model_type = str(config.get("model_type", "unknown"))
    datasets = [datasets] if isinstance(datasets, str) else list(datasets or []) or None
    results = _eval_results(eval_results or [])
    model_title = repo_id.split("/")[-1]
    card_data = ModelCardData(
        library_name="transformers",
        pipeline_tag="text-generation",
        license=license,
        base_model=base_model,
        datasets=datasets,
        tags=[*TAGS, model_type],
        model_name=model_title if results else None,
        eval_results=results or None,
    )
    content = TEMPLATES.get_template("model_card.md").render(
        card_data=card_data.to_yaml(),
        base_model=base_model,
        datasets=datasets,
        repo_id=repo_id,
        model_title=model_title,
        model_type=model_type,
        is_relational=model_type == RELATIONAL_MODEL_TYPE,
        gauge=config.get("gauge", "pivot"),
        has_remote_code="auto_map" in config,
        has_tokenizer=any((checkpoint_dir / name).is_file() for name in TOKENIZER_FILES),
        architecture=_architecture_rows(config, stored_parameters(checkpoint_dir)),
        parameter_table=parameter_table.strip() if parameter_table else None,
        training_settings=[(name, _format(value)) for name, value in (training_settings or {}).items()],
        settings_title=settings_title,
        evaluation=results,
        figures=figures.strip() if figures else None,
        compression=_compression(checkpoint_dir),
    )
    return ModelCard(content)
