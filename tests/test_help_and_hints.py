"""What a new user reads first: install hints that install, help that fits 80 columns."""

from __future__ import annotations

import io

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
    assert "not installed: pip install 'effitrain[8bit]'  (bitsandbytes)" in table.stdout
    assert "not installed: pip install 'effitrain[mini]'  (adam-mini)" in table.stdout
    assert "pip install 'effitrain'" not in table.stdout


def test_compare_and_note_hints_keep_their_extra():
    from effitrain.report import COLUMNS, Reporter, print_comparison

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
