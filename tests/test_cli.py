"""The command line: fast help, the optimizer table, and one clean line for each bad input."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import assert_clean_error

HEAVY = ("torch", "transformers", "accelerate", "datasets", "bitsandbytes", "sklearn")


def test_help_imports_nothing_heavy():
    code = (
        "import sys\n"
        "from effitrain.cli import main\n"
        "try:\n"
        "    main(['--help'])\n"
        "except SystemExit:\n"
        "    pass\n"
        "try:\n"
        "    main(['train', '--help'])\n"
        "except SystemExit:\n"
        "    pass\n"
        f"print([m for m in {HEAVY!r} if m in sys.modules])\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == "[]"


def test_help_lists_commands_options_and_presets(cli):
    top = cli("--help")
    assert top.returncode == 0
    for command in ("train", "optimizers"):
        assert command in top.stdout
    train_help = cli("train", "--help")
    assert train_help.returncode == 0
    for option in (
        "--optim",
        "--lr",
        "--mixed-precision",
        "--metrics-json",
        "--config",
        "--grad-accum",
    ):
        assert option in train_help.stdout
    for preset in ("tiny", "distilbert-base"):
        assert preset in train_help.stdout
    # Every option with a fixed default shows it; the per-optimizer ones say where to look.
    text = " ".join(train_help.stdout.split())
    for default in ("[default: 5]", "[default: 16]", "[default: adamw]", "[default: tiny]"):
        assert default in text, default
    assert text.count("per optimizer, see effitrain optimizers") == 3  # lr, scheduler, warmup
    assert "<bool>" not in text.replace("--help -h <bool>", "")  # flags take no value


def test_version(cli):
    from effitrain import __version__

    proc = cli("--version")
    assert proc.returncode == 0 and __version__ in proc.stdout


def test_optimizers_table_and_json(cli):
    table = cli("optimizers")
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
    rows = json.loads(cli("optimizers", "--json").stdout)
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
def test_bad_options(cli, args, fragments):
    assert_clean_error(cli("train", *args), *fragments)


def test_yaml_unknown_key(cli, tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("optim: adamw\nlearning_rate: 1e-3\n")
    assert_clean_error(
        cli("train", "--config", str(path)), "unknown key 'learning_rate'", str(path)
    )


def test_yaml_wrong_type(cli, tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("epochs: many\n")
    assert_clean_error(cli("train", "--config", str(path)), "'epochs' must be an integer")


def test_debug_env_shows_traceback(cli):
    proc = cli("train", "--optim", "adam", env={"EFFITRAIN_DEBUG": "1"})
    assert proc.returncode != 0
    assert "Traceback" in proc.stderr and "EffitrainError" in proc.stderr


def test_unexpected_error_is_one_line_with_the_debug_hint(capsys, monkeypatch):
    import typer

    from effitrain.cli.errors import user_errors

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
