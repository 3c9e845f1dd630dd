"""Every command's options are dataclasses parsed with Transformers' HfArgumentParser (`relational_hf.commands`):
every option with a range is refused out of range in one line that names its flag, the range and the value, on the
command line and in Python alike; --help documents every option; the dash and underscore spellings parse alike; the
options of `train` and `finetune` reach TrainingArguments unchanged."""

from __future__ import annotations

import dataclasses
import typing

import pytest

from relational_hf.commands import main as cli
from relational_hf.commands.finetune import FinetuneArguments
from relational_hf.commands.options import EachInterval, Interval, NonEmpty, OneOf, TextFile, option_flag
from relational_hf.commands.runs import RunArguments
from relational_hf.commands.train import TrainArguments
from relational_hf.errors import UsageError


def _positionals(options: type) -> list[str]:
    """Placeholder values for the positional arguments a command needs before its options."""
    if options.POSITIONALS is None:
        return []
    return [
        "placeholder"
        for field in dataclasses.fields(options.POSITIONALS)
        if field.metadata.get("nargs") != "*" and (field.default is None or field.metadata.get("nargs") == "+")
    ]


#: command -> (its options dataclass, the arguments that come before its options)
COMMANDS = {
    name: (cli.command_module(name).Arguments, _positionals(cli.command_module(name).Arguments))
    for name in cli.COMMANDS
}
#: the positional fields, which are checked by each command (model sources, folders), not by a range
POSITIONAL = {
    name: {f.name for f in dataclasses.fields(options.POSITIONALS)} if options.POSITIONALS else set()
    for name, (options, _) in COMMANDS.items()
}


def _rule_of(options: type, name: str):
    """The check in the `Annotated` metadata of field `name` (looking through `X | None`), or None."""
    hint = typing.get_type_hints(options, include_extras=True)[name]
    for arg in (hint, *typing.get_args(hint)):
        if typing.get_origin(arg) is typing.Annotated:
            return next(extra for extra in typing.get_args(arg)[1:] if hasattr(extra, "check"))
    return None


def _outside(rule: Interval) -> str:
    """A number just outside `rule`'s range, as typed on the command line."""
    if rule.low is not None:
        value = rule.low - 1 if rule.integer or not rule.low_open else rule.low
    else:
        value = rule.high + 1 if rule.integer or not rule.high_open else rule.high
    return str(value)


def _checked_options() -> list[tuple[str, str, object]]:
    found = []
    for command, (options, _) in COMMANDS.items():
        for field in dataclasses.fields(options):
            rule = _rule_of(options, field.name)
            if (
                rule is not None
                and field.name not in POSITIONAL[command]
                and not isinstance(rule, (OneOf, EachInterval))
            ):
                found.append((command, field.name, rule))
    return found


CHECKED = _checked_options()


# bad input must be refused before training: any Trainer.train call fails the test (conftest); runs in a fresh cwd
pytestmark = pytest.mark.usefixtures("no_training")


def test_every_numeric_option_has_a_range():
    """Each int / float option of every command carries an `Interval` (nothing reaches the work unchecked)."""
    for command, (options, _) in COMMANDS.items():
        hints = typing.get_type_hints(options)
        for field in dataclasses.fields(options):
            kind = hints[field.name]
            if int in (kind, *typing.get_args(kind)) or float in (kind, *typing.get_args(kind)):
                rule = _rule_of(options, field.name)
                assert isinstance(rule, (Interval, EachInterval)), f"{command} {option_flag(field.name)}"
    assert len(CHECKED) >= 60


@pytest.mark.parametrize("command,name,rule", CHECKED, ids=[f"{c} {option_flag(n)}" for c, n, _ in CHECKED])
def test_each_out_of_range_option_is_refused_in_one_line_naming_flag_range_and_value(command, name, rule, capsys):
    options, before = COMMANDS[command]
    flag = option_flag(name)
    if isinstance(rule, Interval):
        value, words = _outside(rule), [f"must be {rule.describe()}"]
    elif isinstance(rule, NonEmpty):
        value, words = " ", ["must not be empty"]
    else:
        assert isinstance(rule, TextFile)
        value, words = "missing.txt", ["missing.txt", "no such file or directory"]
    code = cli.main([command, *before, f"{flag}={value}"])
    err = capsys.readouterr().err
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith(f"relational-hf {command}: error: {flag}"), lines[0]
    for word in [*words, value.strip() or repr(value)]:
        assert word in lines[0], (word, lines[0])


@pytest.mark.parametrize("command,name,rule", CHECKED, ids=[f"{c} {option_flag(n)}" for c, n, _ in CHECKED])
def test_the_same_ranges_hold_for_options_built_in_python(command, name, rule):
    options, _ = COMMANDS[command]
    bad = {Interval: -(10**9) if getattr(rule, "low", None) is not None else 10**9, NonEmpty: "", TextFile: "nope.txt"}
    with pytest.raises(UsageError, match=f"^{option_flag(name)}"):
        options(**{name: bad[type(rule)]})


@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_parses_the_same_way(command):
    """One convention: the command's options are the fields of its dataclass, and its defaults parse to an
    instance equal to the dataclass built in Python with the same positional values."""
    options, before = COMMANDS[command]
    parsed = options.parse(before)
    positional = {name: getattr(parsed, name) for name in POSITIONAL[command]}
    assert parsed == options(**positional)


@pytest.mark.parametrize("command", COMMANDS)
def test_help_documents_every_option(command, capsys):
    options, _ = COMMANDS[command]
    assert cli.main([command, "--help"]) == 0
    printed = capsys.readouterr().out
    squeezed = "".join(printed.split())  # argparse wraps lines, also at hyphens
    for field in dataclasses.fields(options):
        if field.name in POSITIONAL[command]:
            assert field.metadata["metavar"] in printed, field.name
            continue
        assert f"{option_flag(field.name)} " in printed or f"{option_flag(field.name)}\n" in printed, field.name
        text = field.metadata["help"].replace("%%", "%")
        assert "".join(text.split()) in squeezed, f"{command} {option_flag(field.name)}: help text missing"


@pytest.mark.parametrize("command", COMMANDS)
def test_help_names_each_option_once_as_documented(command, capsys):
    """--help (usage line and option list) spells every option --with-dashes, as the README and the descriptions do,
    without its --with_underscores twin, and shows a bool switch without a value placeholder (`--resume`, not
    `--resume [RESUME]`); the hidden spelling still parses (below)."""
    options, _ = COMMANDS[command]
    assert cli.main([command, "--help"]) == 0
    printed = capsys.readouterr().out
    for field in dataclasses.fields(options):
        if field.name in POSITIONAL[command]:
            continue
        flag = option_flag(field.name)
        if "_" in field.name:
            assert "--" + field.name not in printed, f"{command}: {flag} also shown as --{field.name}"
        if typing.get_type_hints(options)[field.name] in (bool, bool | None):
            placeholder = field.name.upper()
            assert f"{flag} [{placeholder}]" not in printed and f"{flag} {placeholder}" not in printed, flag
            assert f"[{flag}]" in " ".join(printed.split()), f"{command}: {flag} missing from the usage line"


@pytest.mark.parametrize("command", COMMANDS)
def test_every_spelling_of_every_option_parses(command):
    """Each option's --with-dashes and --with_underscores spellings both reach the same field."""
    options, before = COMMANDS[command]
    parser = options.argument_parser()
    for action in parser._actions:
        names = [n for n in action.option_strings if n.startswith("--") and n != "--help"]
        assert not names or "_" not in names[0], f"{command}: {names} (the documented spelling first)"
        for name in names:
            assert parser._option_string_actions[name] is action


@pytest.mark.parametrize("command", ["train", "finetune"])
def test_dash_and_underscore_spellings_parse_alike(command):
    options, before = COMMANDS[command]
    dashed = ["--batch-size", "3", "--learning-rate", "0.01", "--output-dir", "run", "--resume", "--max-steps", "7"]
    underscored = ["--" + arg[2:].replace("-", "_") if arg.startswith("--") else arg for arg in dashed]
    a = options.parse([*before, *dashed])
    b = options.parse([*before, *underscored])
    assert a == b
    assert (a.batch_size, a.learning_rate, a.output_dir, a.resume, a.max_steps) == (3, 0.01, "run", True, 7)


def test_options_reach_training_arguments_unchanged(tmp_path):
    """`RunArguments.training_arguments` is the one mapping: each option lands in its TrainingArguments field."""
    options = FinetuneArguments(
        model="m", batch_size=3, gradient_accumulation_steps=2, max_steps=11, learning_rate=0.02, warmup_steps=4,
        weight_decay=0.1, seed=5, logging_steps=6, save_steps=9, projection="update", parallel_suppression=0.3,
        parallel_suppression_site="value",
    )  # fmt: skip
    args = options.training_arguments(tmp_path / "trainer_state", report_to=["tensorboard"])
    mapped = {
        "per_device_train_batch_size": 3, "gradient_accumulation_steps": 2, "max_steps": 11, "learning_rate": 0.02,
        "warmup_steps": 4, "weight_decay": 0.1, "seed": 5, "logging_steps": 6, "save_steps": 9,
        "symmetry_projection": "update", "parallel_suppression_coef": 0.3, "parallel_suppression_site": "value",
        "report_to": ["tensorboard"], "output_dir": str(tmp_path / "trainer_state"),
    }  # fmt: skip
    assert {name: getattr(args, name) for name in mapped} == mapped
    assert options.train_samples == 11 * 3 * 2
    # the commands' own defaults: train and finetune share the fields, not the defaults
    assert (TrainArguments().batch_size, FinetuneArguments().batch_size) == (16, 8)
    assert RunArguments().batch_size == TrainArguments().batch_size


def test_fsdp_options_reach_training_arguments_as_fsdp2(tmp_path, monkeypatch):
    """--fsdp maps to `fsdp=True` with fsdp_config version 2 (sharding units: the model's `_no_split_modules`);
    --fsdp-config adds its settings and implies --fsdp; without either, no FSDP."""
    monkeypatch.setenv("FSDP_CPU_RAM_EFFICIENT_LOADING", "false")  # TrainingArguments sets it; restored afterwards
    plain = FinetuneArguments(model="m").training_arguments(tmp_path / "a")
    assert not plain.fsdp
    args = FinetuneArguments(model="m", fsdp=True).training_arguments(tmp_path / "b")
    assert args.fsdp and args.fsdp_config["version"] == 2 and args.fsdp_plugin_args["fsdp_version"] == 2
    config = tmp_path / "fsdp.json"
    config.write_text('{"reshard_after_forward": false, "cpu_offload": true}')
    options = TrainArguments(fsdp_config=str(config))
    assert options.uses_fsdp
    args = options.training_arguments(tmp_path / "c")
    assert args.fsdp and args.fsdp_plugin_args["reshard_after_forward"] is False
    assert args.fsdp_plugin_args["cpu_offload"] is True


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ('{"version": 1}', "only FSDP version 2 is supported"),
        ("[1, 2]", "must hold a JSON object"),
        ("{version: 2", "is not valid JSON"),
    ],
)
def test_bad_fsdp_config_is_refused_in_one_line_naming_the_flag(tmp_path, content, message):
    config = tmp_path / "fsdp.json"
    config.write_text(content)
    with pytest.raises(UsageError, match=f"^--fsdp-config: .*{message}"):
        FinetuneArguments(model="m", fsdp_config=str(config))


def test_fsdp_in_one_process_and_fsdp_with_lora_are_refused(tmp_path, monkeypatch, no_training):
    from relational_hf.commands import finetune, train

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    (tmp_path / "t.txt").write_text("some text\n" * 50)
    with pytest.raises(UsageError, match="^--fsdp shards the model over several processes: launch with torchrun"):
        train.check(TrainArguments(fsdp=True))
    monkeypatch.setenv("WORLD_SIZE", "2")
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    with pytest.raises(UsageError, match=r"^--fsdp shards full fine-tuning \(--method full\)"):
        finetune.check(
            FinetuneArguments(model=str(model), train_file=str(tmp_path / "t.txt"), method="lora", fsdp=True)
        )
