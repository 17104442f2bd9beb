"""The command line: fast help, the optimizer table, and one clean line for each bad input."""

from __future__ import annotations

import inspect
import json
import subprocess
import sys
import typing

import pytest
import typer

from tests.conftest import assert_clean_error

HEAVY = ("torch", "transformers", "accelerate", "datasets", "bitsandbytes", "sklearn")


def test_help_imports_nothing_heavy():
    """The fresh interpreter is the point: what importing the CLI and printing help loads."""
    code = (
        "import sys\n"
        "from effitrain.cli import main\n"
        "for args in (['--help'], ['train', '--help'], ['estimate', '--help'],"
        " ['compare', '--help']):\n"
        "    try:\n"
        "        main(args)\n"
        "    except SystemExit:\n"
        "        pass\n"
        f"print([m for m in {HEAVY!r} if m in sys.modules])\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == "[]"


def _help(*args: str) -> str:
    from typer.testing import CliRunner

    from effitrain.cli import app

    result = CliRunner().invoke(app, [*args, "--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    return " ".join(result.stdout.split())


COMMANDS = ("train", "estimate", "compare", "inspect-state", "optimizers")


def test_no_arguments_show_the_help(train_cli):
    proc = train_cli()  # exit code 2, as click has it for a missing command
    assert "Commands" in proc.stdout and "train" in proc.stdout and "error" not in proc.stderr


def test_help_lists_commands_options_and_presets():
    top = _help()
    for command in COMMANDS:
        assert command in top
    text = _help("train")
    for option in ("--optim", "--lr", "--mixed-precision", "--metrics-json", "--config"):
        assert option in text
    for preset in ("tiny", "distilbert-base", "tiny-llama"):
        assert preset in text
    # Every option with a fixed default shows it; the per-optimizer ones say where to look.
    for default in ("[default: 5]", "[default: 16]", "[default: adamw]", "[default: tiny]"):
        assert default in text, default
    assert text.count("per optimizer, see effitrain optimizers") == 3  # lr, scheduler, warmup


@pytest.mark.parametrize("command", ["", *COMMANDS])
def test_help_has_no_type_tags(command):
    """Flags take no value and every value has a metavar that says what it is: no ``<bool>``,
    ``<int>``, ``<path>`` or ``<int range> [x>=1]``."""
    import re

    text = _help(*([command] if command else []))
    assert not re.search(r"<(bool|int|float|text|path|str)\b|range\]|\[x[<>]", text), text


def test_each_command_has_one_whole_line():
    """`effitrain --help` lists each command with the first paragraph of its docstring: one
    sentence that fits the line, never a sentence cut in two."""
    from effitrain.cli import app

    top = _help()
    for info in app.registered_commands:
        first = info.help.split("\n\n")[0]
        assert "\n" not in first and first.endswith("."), first
        assert len(first) <= 100 and first in top, first
        # Later paragraphs are one line each too, for the terminal to wrap.
        assert "\n" not in info.help.replace("\n\n", ""), info.help
    assert "classifier or a causal LM" in top  # train trains both


def test_every_config_field_is_an_option_of_train_once():
    from effitrain.cli.options import config_fields, panels
    from effitrain.cli.train import train

    paneled = [name for names in panels().values() for name in names]
    assert sorted(paneled) == sorted(config_fields())  # each in exactly one panel
    options = inspect.signature(train).parameters
    assert set(config_fields()) <= set(options)


def test_estimate_and_compare_share_trains_declarations():
    """estimate takes every train option (lists those that change memory); compare takes all
    but those it sets itself; the same field has the same flag and help in all three."""
    from effitrain.cli import compare, estimate, train
    from effitrain.cli.options import config_fields

    def options(command) -> dict:
        return {
            name: typing.get_args(param.annotation)[1]
            for name, param in inspect.signature(command).parameters.items()
            if name in config_fields() and (command is train.train or name not in OWN)
        }

    OWN = ("optim", "output_dir")  # estimate's and compare's own: several names, compare's folder
    trains, estimates, compares = (
        options(c) for c in (train.train, estimate.estimate, compare.compare)
    )
    assert set(estimates) == set(config_fields()) - set(OWN)
    assert {n for n, info in estimates.items() if not info.hidden} == set(estimate.SHOWN)
    assert set(compares) == set(config_fields()) - set(compare.NOT_SHARED)
    for name, info in [*estimates.items(), *compares.items()]:
        assert info.param_decls == trains[name].param_decls, name
        assert info.help.startswith(trains[name].help.split(" Presets:")[0]), name
    assert inspect.signature(compare.compare).parameters["max_steps"].default == 10


def test_options_given_become_overrides():
    """Only what the command line gives is an override (a YAML file keeps what it sets),
    typed as TrainConfig takes it; to_arguments spells overrides back as train options."""
    from typer.testing import CliRunner

    from effitrain.cli.options import config_options
    from effitrain.config import to_arguments

    seen = {}

    @config_options()
    def command(*, overrides):
        seen.update(overrides)

    app = typer.Typer()
    app.command()(command)
    args = ["--batch-size", "8", "--lr", "3e-4", "--text-columns", "a,b", "--no-packing"]
    args += ["--gradient-checkpointing", "--no-memory-breakdown", "--optim", "adafactor"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    expected = {
        "batch_size": 8,
        "lr": 3e-4,
        "text_columns": "a,b",
        "packing": False,
        "gradient_checkpointing": True,
        "memory_breakdown": False,
        "optim": "adafactor",
    }
    assert seen == expected
    seen.clear()
    assert CliRunner().invoke(app, to_arguments(expected)).exit_code == 0
    assert seen == expected


def test_version(train_cli):
    from effitrain import __version__

    proc = train_cli("--version")
    assert proc.returncode == 0 and __version__ in proc.stdout


def test_optimizers_table_and_json(train_cli):
    table = train_cli("optimizers")
    assert table.returncode == 0, table.stderr
    for name in (
        "adamw",
        "adafactor",
        "adafactor-hf",
        "adamw-8bit",
        "sgd",
        "torch.optim.Adafactor",
    ):
        assert name in table.stdout
    assert table.stderr == ""  # no library notices
    rows = json.loads(train_cli("optimizers", "--json").stdout)
    by_name = {row["name"]: row for row in rows}
    assert by_name["adamw"]["available"] is True
    assert by_name["adamw-8bit"]["class"] == "bitsandbytes.optim.AdamW8bit"
    scratch, tune = "training from scratch", "fine-tuning"
    assert by_name["adafactor"]["defaults"][scratch]["lr"] == 3e-2
    assert by_name["adafactor"]["defaults"][tune]["lr"] == 3e-3
    assert by_name["sgd"]["caveat"] and not by_name["adamw"]["caveat"]
    # adam-mini fine-tunes at a quarter of AdamW's lr, and says what failed above it.
    assert by_name["adam-mini"]["defaults"][tune]["lr"] == 5e-5
    assert "above lr 5e-5 failed long texts" in by_name["adam-mini"]["caveat"]
    # Readable in an 80-column terminal: no line wraps, each optimizer in its own block.
    assert max(len(line) for line in table.stdout.splitlines()) <= 80
    assert "fine-tuning   lr 3e-3, 10% warmup, then linear" in table.stdout
    assert "note: its defaults fail the demo from scratch and long texts" in table.stdout
    # bytes/param: the measured figure (effitrain/optim/state_bytes.json), then the spec's note.
    assert "bytes/param: 2.04 (tensors < 4096 elements keep fp32 state: 8)" in table.stdout
    assert by_name["adamw-8bit"]["bytes_per_param"] == (
        "2.04 (tensors < 4096 elements keep fp32 state: 8)"
    )
    assert by_name["adamw"]["bytes_per_param"] == "8.00"


# --- bad input: each gives one line, a non-zero exit and no traceback ---------------------------


@pytest.mark.parametrize(
    ("args", "fragments"),
    [
        (["--optim", "adam"], ["unknown optimizer 'adam'", "adafactor", "adamw-8bit"]),
        (["--lr", "-1"], ["--lr must be greater than 0"]),
        (["--lr", "0"], ["--lr must be greater than 0"]),
        (["--batch-size", "0"], ["--batch-size must be greater than 0"]),
        (["--epochs", "-2"], ["--epochs must be greater than 0"]),
        (["--scheduler", "step"], ["unknown --scheduler"]),
    ],
)
def test_bad_options(train_cli, args, fragments):
    assert_clean_error(train_cli("train", *args), *fragments)


@pytest.mark.parametrize(
    ("args", "line"),
    [
        (
            ["train", "--no-such-flag"],
            "no such option: --no-such-flag (see effitrain train --help)",
        ),
        (["train", "--max-step", "3"], "no such option: --max-step (Possible options: "),
        (["estimate", "--batch-size", "x"], "invalid value for '--batch-size': "),
        (["trian"], "no such command 'trian'. Did you mean 'train'? (see effitrain --help)"),
        (["inspect-state"], "missing argument 'PATH' (see effitrain inspect-state --help)"),
    ],
)
def test_usage_errors_are_one_line(train_cli, args, line):
    """What click refuses while parsing (typer would draw it in a box) is one line too."""
    error = assert_clean_error(train_cli(*args))
    assert error.startswith(f"error: {line}"), error
    assert "╭" not in train_cli(*args).stderr


@pytest.mark.parametrize(
    "key, option",
    [("learning_rate", "lr"), ("lora_r", "lora_rank")],  # the config's own, a lever's
)
def test_yaml_key_of_another_tool_names_ours(train_cli, tmp_path, key, option):
    """Each option declares its names in the Trainer's and TRL's configs (Option.elsewhere)."""
    path = tmp_path / "bad.yaml"
    path.write_text(f"optim: adamw\n{key}: 1\n")
    assert_clean_error(
        train_cli("train", "--config", str(path)),
        f"unknown key '{key}'",
        str(path),
        f"did you mean '{option}'?",
    )


def test_yaml_wrong_type(train_cli, tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("epochs: many\n")
    assert_clean_error(train_cli("train", "--config", str(path)), "'epochs' must be an integer")


def test_debug_env_shows_traceback(train_cli, monkeypatch):
    monkeypatch.setenv("EFFITRAIN_DEBUG", "1")
    proc = train_cli("train", "--optim", "adam")
    assert proc.returncode != 0
    assert "Traceback" in proc.stderr and "EffitrainError" in proc.stderr


def test_unexpected_error_is_one_line_with_the_debug_hint(capsys, monkeypatch):
    import typer

    from effitrain.cli.error_handling import user_errors

    monkeypatch.delenv("EFFITRAIN_DEBUG", raising=False)
    for exc, line in [
        (ValueError("\n  bad value\nmore detail"), "ValueError: bad value"),
        (RuntimeError(), "RuntimeError: "),
    ]:
        with pytest.raises(typer.Exit) as info, user_errors():
            raise exc
        assert info.value.exit_code == 1
        hint = "(set EFFITRAIN_DEBUG=1 to see the traceback)"
        assert capsys.readouterr().err == f"error: {line} {hint}\n"
