"""TrainConfig: defaults, YAML, CLI precedence, strict keys and types, validation."""

from __future__ import annotations

import pytest

from effitrain.build import checked_config
from effitrain.config import TrainConfig, option
from effitrain.errors import EffitrainError
from effitrain.optim import get_spec, resolve_hyperparameters
from tests.conftest import assert_clean_error


def write(tmp_path, text: str):
    path = tmp_path / "run.yaml"
    path.write_text(text)
    return path


def test_defaults_are_valid():
    config = checked_config()
    assert config == TrainConfig()
    assert config.model == "tiny" and config.dataset == "demo" and config.optim == "adamw"


def test_yaml_overrides_defaults_and_cli_overrides_yaml(tmp_path):
    path = write(tmp_path, "optim: adafactor\nbatch_size: 8\nlr: 3e-4\nepochs: 2\n")
    config = checked_config(path, {"batch_size": 16, "epochs": None})
    assert config.optim == "adafactor"  # from YAML
    assert config.batch_size == 16  # CLI wins
    assert config.epochs == 2  # None means "not given on the command line"
    assert config.lr == pytest.approx(3e-4)  # YAML's 3e-4 is a string to PyYAML; accepted


def test_yaml_accepts_dashed_keys_and_lists(tmp_path):
    path = write(tmp_path, "text-columns: [question, sentence]\nlabel-column: y\n")
    config = checked_config(path)
    assert config.text_columns == ["question", "sentence"]
    assert config.label_column == "y"


def test_comma_separated_text_columns_from_cli():
    assert checked_config(None, {"text_columns": "a, b"}).text_columns == ["a", "b"]


def test_unknown_yaml_key_names_it(tmp_path):
    path = write(tmp_path, "optim: adamw\nbatchsize: 8\n")
    with pytest.raises(EffitrainError, match="unknown key 'batchsize'") as info:
        checked_config(path)
    assert str(path) in str(info.value)


@pytest.mark.parametrize(
    ("text", "key"),
    [
        ("epochs: three\n", "epochs"),
        ("lr: fast\n", "lr"),
        ("quiet: 1\n", "quiet"),
        ("batch_size: 8.5\n", "batch_size"),
        ("epochs: true\n", "epochs"),
        ("model: [a]\n", "model"),
    ],
)
def test_wrong_type_names_key(tmp_path, text, key):
    with pytest.raises(EffitrainError, match=f"'{key}' must be"):
        checked_config(write(tmp_path, text))


def test_yaml_must_be_a_mapping(tmp_path):
    with pytest.raises(EffitrainError, match="mapping"):
        checked_config(write(tmp_path, "- a\n- b\n"))


def test_invalid_yaml_and_missing_file(tmp_path):
    with pytest.raises(EffitrainError, match="not valid YAML"):
        checked_config(write(tmp_path, "a: [unclosed\n"))
    with pytest.raises(EffitrainError, match="config file not found"):
        checked_config(tmp_path / "nope.yaml")


def test_empty_yaml_is_defaults(tmp_path):
    assert checked_config(write(tmp_path, "")) == TrainConfig()


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("lr", -1.0),
        ("lr", 0.0),
        ("batch_size", 0),
        ("batch_size", -4),
        ("epochs", 0),
        ("grad_accum", 0),
        ("max_steps", 0),
        ("max_length", 0),
    ],
)
def test_non_positive_values_are_refused(field, value):
    with pytest.raises(EffitrainError, match=f"{option(field)} must be greater than 0"):
        checked_config(None, {field: value})


def test_other_validation():
    with pytest.raises(EffitrainError, match="--weight-decay must be 0 or more"):
        checked_config(None, {"weight_decay": -0.1})
    with pytest.raises(EffitrainError, match="unknown --scheduler 'step'"):
        checked_config(None, {"scheduler": "step"})
    with pytest.raises(EffitrainError, match="unknown --mixed-precision 'fp8'"):
        checked_config(None, {"mixed_precision": "fp8"})
    with pytest.raises(EffitrainError, match="one or two column names"):
        checked_config(None, {"text_columns": "a,b,c"})


def test_unknown_optimizer_lists_valid_ones():
    with pytest.raises(EffitrainError, match="unknown optimizer 'adam'") as info:
        checked_config(None, {"optim": "adam"})
    for name in ("adamw", "adafactor", "adafactor-hf", "adamw-8bit", "sgd"):
        assert name in str(info.value)


def test_lr_is_the_explicit_one_else_the_optimizers_default():
    assert (
        resolve_hyperparameters(TrainConfig(optim="adafactor")).lr
        == get_spec("adafactor").scratch.lr
    )
    assert resolve_hyperparameters(TrainConfig(optim="adafactor", lr=0.5)).lr == 0.5


@pytest.mark.parametrize(
    ("model", "regime", "words"),
    [("tiny", "scratch", "training from scratch"), ("./my-model", "fine_tune", "fine-tuning")],
)
def test_defaults_depend_on_optimizer_and_regime(model, regime, words):
    """A preset trains from random init; a hub id or folder holds pretrained weights."""
    for name in ("adamw", "adafactor", "adafactor-hf", "adamw-8bit", "sgd"):
        hyper = resolve_hyperparameters(TrainConfig(model=model, optim=name))
        expected = getattr(get_spec(name), regime)
        assert hyper.lr == expected.lr
        assert hyper.warmup_ratio == expected.warmup_ratio
        assert hyper.scheduler == expected.scheduler
        assert hyper.lr_note == hyper.schedule_note == f"{name} default for {words}"
    explicit = resolve_hyperparameters(
        TrainConfig(model=model, lr=0.5, scheduler="cosine", warmup_ratio=0.2)
    )
    assert (explicit.lr, explicit.scheduler) == (0.5, "cosine")
    assert explicit.warmup_ratio == 0.2 and explicit.lr_note == explicit.schedule_note == ""


@pytest.mark.parametrize(
    ("overrides", "periodic", "saves"),
    [
        ({}, False, False),
        ({"output_dir": "out"}, False, False),
        ({"output_dir": "out", "save_every": 5}, True, True),
        ({"output_dir": "out", "save_strategy": "epoch"}, True, True),
        ({"output_dir": "out", "save_strategy": "no"}, False, False),
    ],
)
def test_checkpoint_predicates(overrides, periodic, saves):
    config = checked_config(None, overrides)
    assert config.wants_periodic_checkpoints is periodic
    assert config.saves_checkpoints is saves


@pytest.mark.parametrize("overrides", [{"save_every": 5}, {"save_strategy": "epoch"}])
def test_periodic_checkpoints_need_an_output_dir(overrides):
    with pytest.raises(EffitrainError, match="checkpoints need a folder: add --output-dir DIR"):
        checked_config(None, overrides)
    assert TrainConfig(**overrides).wants_periodic_checkpoints
    assert not TrainConfig(**overrides).saves_checkpoints


def test_shipped_yaml_configs_load():
    from pathlib import Path

    configs = sorted((Path(__file__).parent.parent / "configs" / "train").glob("*.yaml"))
    assert configs, "configs/train/ should ship at least one example"
    for path in configs:
        checked_config(path)


@pytest.mark.parametrize(
    "args,fragment",
    [
        (["--seed", "-1"], "--seed must be from 0 to 2**32 - 1 (got -1)"),
        (["--seed", str(2**32)], "--seed must be from 0 to 2**32 - 1"),
        (["--lr", "inf"], "--lr must be a finite number (got inf)"),
        (["--lr", "nan"], "--lr must be a finite number (got nan)"),
        (["--weight-decay", "inf"], "--weight-decay must be a finite number"),
    ],
    ids=["seed-negative", "seed-too-large", "lr-inf", "lr-nan", "weight-decay-inf"],
)
@pytest.mark.parametrize("command", ["train", "estimate"])
def test_out_of_range_numbers_are_refused_before_anything_is_built(
    train_cli, command, args, fragment
):
    """train and estimate check the same config: a seed numpy cannot take (train raised
    ValueError there), an lr that trains until the loss is NaN."""
    assert_clean_error(train_cli(command, *args), fragment)
