"""What a new user reads first: install hints that install, help that fits 80 columns."""

from __future__ import annotations

import io

import pytest

from tests.conftest import hide_package


def _console(width: int = 200):
    from rich.console import Console

    return Console(file=io.StringIO(), width=width, highlight=False)


def test_optimizers_install_hint_keeps_its_extra(train_cli, monkeypatch):
    """rich read ``[mini]`` as markup and printed ``pip install 'effitrain'``."""
    hide_package(monkeypatch, "bitsandbytes")
    hide_package(monkeypatch, "adam_mini")
    table = train_cli("optimizers")
    assert table.returncode == 0, table.stderr
    lines = table.stdout.splitlines()
    assert "  not installed: pip install 'effitrain[8bit]'  (bitsandbytes)" in lines
    assert "  not installed: pip install 'effitrain[mini]'  (adam-mini)" in lines
    assert "pip install 'effitrain'" not in table.stdout


def test_compare_and_note_hints_keep_their_extra():
    from effitrain.report.comparison_table import COLUMNS, print_comparison
    from effitrain.report.live import Reporter

    row = {"label": "adamw", **{key: None for _, key in COLUMNS}}
    console = _console()
    print_comparison([row], {}, {}, console=console)
    assert "pip install 'effitrain[plot]'" in console.file.getvalue()
    console = _console()
    Reporter(console=console).note("--lora needs peft: pip install 'effitrain[lora]'")
    assert "pip install 'effitrain[lora]'" in console.file.getvalue()


def test_yaml_unknown_key_says_what_was_meant(train_cli, tmp_path):
    """It listed all 58 keys on one line, with no guess."""
    from tests.conftest import assert_clean_error

    path = tmp_path / "bad.yaml"
    for key, hint in (
        ("lerning_rate", "did you mean 'lr'?"),  # a typo of transformers' name
        ("batchsize", "did you mean 'batch_size'?"),
        ("colour", "the keys are the options of effitrain train --help (batch_size: 16)"),
    ):
        path.write_text(f"{key}: 1\n")
        error = assert_clean_error(train_cli("train", "--config", str(path)))
        assert error == f"error: unknown key '{key}' in {path}; {hint}"


def _narrow(*args: str, columns: int):
    """``effitrain ARGS`` in this process in a terminal ``columns`` wide."""
    from typer.testing import CliRunner

    from effitrain.cli import app
    from tests.conftest import OFFLINE, _reset_accelerate

    _reset_accelerate()
    result = CliRunner().invoke(app, list(args), env={"COLUMNS": str(columns), **OFFLINE})
    _reset_accelerate()
    return result


def test_preference_lines_fit_100_columns_and_say_an_unknown_peak_once(tmp_path):
    """Step lines were ~115 characters and the closing line ended 'MFU: peak of cpu unknown'."""
    import json

    path = tmp_path / "pairs.jsonl"
    rows = [{"prompt": f"Q{i}:", "chosen": f" yes {i}", "rejected": f" no {i}"} for i in range(8)]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    # orpo: no reference pass to wait for, and the same reward columns as dpo
    options = "--max-length 16 --batch-size 2 --max-steps 3 --log-every 1 --preference-loss orpo"
    result = _narrow(
        "train", "--task", "preference", "--train-file", str(path), *options.split(), columns=100
    )
    assert result.exit_code == 0, result.output
    # the progress lines and the closing ones (the banner's lines are one line each, as long as
    # they need: a terminal wraps them)
    ends = ("step ", "eval ", "done ", "  speed ")
    lines = [line for line in result.stdout.splitlines() if line.startswith(ends)]
    assert len(lines) == 6 and max(len(line) for line in lines) <= 100, max(lines, key=len)
    assert sum(line.startswith("step ") for line in lines) == 3
    assert result.stdout.count("peak FLOP/s of cpu is unknown") == 1
    assert "MFU" not in next(line for line in lines if line.startswith("  speed"))


@pytest.mark.parametrize(
    "command", ["train", "estimate", "plan", "compare", "inspect-state", "optimizers", None]
)
def test_help_at_80_columns_shows_every_option_whole(command):
    """rich cut option names to fit 80 columns: ``--gradient-checkpoint…``."""
    import typer

    from effitrain.cli import app

    args = [command] if command else []
    result = _narrow(*args, "--help", columns=80)
    assert result.exit_code == 0, result.output
    assert "…" not in result.stdout
    assert max(len(line) for line in result.stdout.splitlines()) <= 80
    click_command = typer.main.get_command(app)
    if command:
        click_command = click_command.commands[command]
    words = set(result.stdout.replace(",", " ").split())
    for param in click_command.params:
        if getattr(param, "hidden", False):
            continue  # taken, not listed
        for name in (*param.opts, *param.secondary_opts):
            if name.startswith("-"):
                assert name in words, name


def test_inspect_states_names_are_told_apart_at_80_columns():
    """Every row read ``distilbert.trans…`` at 80 columns."""
    from effitrain.report.state_tables import largest_states_table
    from effitrain.results import ParamState

    names = [
        f"distilbert.transformer.layer.{layer}.attention.{part}_lin.weight"
        for layer in range(2)
        for part in ("q", "k", "v", "out")
    ]
    names.append("distilbert.embeddings.word_embeddings.weight")
    keys = ["step", "exp_avg_sq_row", "exp_avg_sq_col"]
    rows = [
        ParamState(name, [128, 128], 128 * 128, 1024, keys, f"factored ({i} + 128 values)")
        for i, name in enumerate(names)
    ]
    console = _console(80)
    console.print(largest_states_table(rows, 10, console.width))
    text = console.file.getvalue()
    lines = text.splitlines()
    assert max(len(line) for line in lines) <= 80
    assert lines[0].strip() == "Largest per-parameter states (top 10), names under distilbert."
    assert "every row: state keys step, exp_avg_sq_row, exp_avg_sq_col" in text
    cells = [line.split("│")[1].strip() for line in lines if line.startswith("│")]
    assert len(set(cells)) == len(names)  # each row's name its own
    assert "…1.attention.out_lin.weight" in cells  # its end: what tells it apart
    assert "…word_embeddings.weight" in cells
