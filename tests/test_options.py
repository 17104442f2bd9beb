"""One option table: each TrainConfig field declares its flag, off flag, panel, metavar, choices
and default text once (effitrain.config.OPTIONS); the CLI, validation, compare's arguments and
the resume command a stopped run prints all derive from it, and all round-trip through the real
``effitrain train`` parser."""

from __future__ import annotations

import dataclasses
import shlex
import typing

import pytest

from effitrain.checkpoint import resume_command
from effitrain.cli.compare import train_config
from effitrain.config import (
    GRPO_LOSSES,
    HELP_PANELS,
    MIXED_PRECISION,
    OPTIONS,
    PREFERENCE_LOSSES,
    SAVE_STRATEGIES,
    SCALE_REWARDS,
    SCHEDULERS,
    TRACKERS,
    TrainConfig,
    to_arguments,
)
from effitrain.errors import EffitrainError
from effitrain.levers.bf16_weights import WEIGHTS_DTYPES
from effitrain.levers.chunked_loss import CHUNKED_LOSS
from effitrain.levers.optimizer_offload import OPTIMIZER_OFFLOAD
from effitrain.levers.reference import REFERENCE_DTYPES, REFERENCES

CAUSAL = {"task": "causal-lm", "model": "tiny-llama"}
PREFERENCE = {"task": "preference", "model": "tiny-llama"}
GRPO = {"task": "grpo", "model": "tiny-llama"}
LORA = {"lora_rank": 4}

VALUES: dict[str, tuple[object, dict[str, object]]] = {
    "task": ("causal-lm", {"model": "tiny-llama"}),
    "model": ("small", {}),
    "dataset": ("glue", {}),
    "dataset_config": ("mrpc", {}),
    "train_file": ("train.csv", {}),
    "validation_file": ("validation.csv", {}),
    "text_columns": (["sentence1", "sentence2"], {}),
    "label_column": ("label", {}),
    "max_length": (64, {}),
    "beyond_positions": (True, {}),
    "packing": (False, CAUSAL),
    "completion_only_loss": (False, CAUSAL),
    "sample_prompt": ("Once upon a time", CAUSAL),
    "preference_loss": ("orpo", PREFERENCE),
    "beta": (0.2, PREFERENCE),
    "label_smoothing": (0.1, PREFERENCE),
    "simpo_gamma": (1.0, {**PREFERENCE, "preference_loss": "simpo"}),
    "num_generations": (4, GRPO),
    "max_completion_length": (32, GRPO),
    "temperature": (0.7, GRPO),
    "top_p": (0.9, GRPO),
    "reward": (["rewards.py:exact", "rewards.py:short"], GRPO),
    "reward_weights": ([1.0, 0.5], {**GRPO, "reward": ["rewards.py:exact", "rewards.py:short"]}),
    "grpo_loss": ("grpo", GRPO),
    "scale_rewards": ("batch", GRPO),
    "epsilon": (0.1, GRPO),
    "epsilon_high": (0.28, GRPO),
    "num_iterations": (2, GRPO),
    "optim": ("adafactor", {}),
    "lr": (3e-4, {}),
    "weight_decay": (0.1, {}),
    "scheduler": ("cosine", {}),
    "warmup_ratio": (0.25, {}),
    "warmup_steps": (3, {}),
    "max_grad_norm": (0.5, {}),
    "fp32_embedding_state": (True, {"optim": "adamw-8bit"}),
    "epochs": (2, {}),
    "max_steps": (7, {}),
    "batch_size": (4, {}),
    "eval_batch_size": (8, {}),
    "grad_accum": (2, {}),
    "mixed_precision": ("bf16", {}),
    "seed": (7, {}),
    "log_every": (3, {}),
    "max_memory": ("24GiB", {}),
    "gradient_checkpointing": (True, {}),
    "tiled_mlp": (True, CAUSAL),
    "mlp_tiles": (4, {**CAUSAL, "tiled_mlp": True}),
    "tiled_norm": (True, CAUSAL),
    "optimizer_in_backward": (True, {}),
    "weights_dtype": ("bf16", {}),
    "chunked_loss": ("torch", CAUSAL),
    "activation_offload": (True, {}),
    "optimizer_offload": ("state", {}),
    "reference": ("copy", PREFERENCE),
    "reference_dtype": ("bf16", {**PREFERENCE, "reference": "copy"}),
    "context_parallel": (2, {**CAUSAL, "packing": False}),
    "lora_rank": (8, {}),
    "lora_alpha": (32.0, LORA),
    "lora_dropout": (0.1, LORA),
    "lora_target_modules": (["q_lin", "v_lin"], LORA),
    "lora_merge": (True, LORA),
    "lean_lora": (True, LORA),
    "load_in_4bit": (True, LORA),
    "output_dir": ("out", {}),
    "save_every": (5, {"output_dir": "out"}),
    "save_strategy": ("epoch", {"output_dir": "out"}),
    "save_total_limit": (2, {}),
    "resume": ("latest", {"output_dir": "out"}),
    "metrics_json": ("metrics.json", {}),
    "report_to": (["tensorboard", "wandb"], {}),
    "memory_breakdown": (False, {}),
    "quiet": (True, {}),
}
"""Per field: a value that is not its default, and the other options it needs to be valid."""


def changed(config: TrainConfig) -> dict[str, object]:
    """The config's values that are not the defaults, by field name."""
    defaults = TrainConfig()
    return {
        f.name: getattr(config, f.name)
        for f in dataclasses.fields(config)
        if getattr(config, f.name) != getattr(defaults, f.name)
    }


def resumed(command: str) -> TrainConfig:
    """The config of a printed resume command, parsed as ``effitrain train`` would."""
    words = shlex.split(command)
    if words[:2] != ["effitrain", "train"]:  # accelerate launch <options> -m effitrain train
        words = words[words.index("-m") + 1 :]
    assert words[:2] == ["effitrain", "train"], command
    return train_config(words[2:])


def test_the_value_table_covers_every_field():
    """A new field fails here until it has a value to round-trip."""
    assert set(VALUES) == set(OPTIONS)
    assert list(OPTIONS) == [f.name for f in dataclasses.fields(TrainConfig)]
    hints = typing.get_type_hints(TrainConfig)
    for name, (value, _) in VALUES.items():
        assert value != TrainConfig.__dataclass_fields__[name].default, name
        annotation = hints[name]
        allowed = typing.get_args(annotation) or (annotation,)
        assert any(isinstance(value, typing.get_origin(a) or a) for a in allowed), name


@pytest.mark.parametrize("name", list(VALUES))
def test_every_field_round_trips_through_the_train_command(name):
    value, companions = VALUES[name]
    config = TrainConfig(**{**companions, name: value}).validate()
    arguments = to_arguments(changed(config))
    assert train_config(arguments) == config, arguments


def test_on_off_options_spell_their_off_flag():
    assert to_arguments({"completion_only_loss": False}) == ["--full-loss"]
    assert to_arguments({"completion_only_loss": True}) == ["--completion-only-loss"]
    assert to_arguments({"packing": False, "memory_breakdown": False}) == [
        "--no-packing",
        "--no-memory-breakdown",
    ]
    assert to_arguments({"quiet": False, "lr": None}) == []  # off and unset are the defaults
    assert to_arguments({"report_to": ["tensorboard", "wandb"]}) == [
        "--report-to",
        "tensorboard,wandb",
    ]
    # An option that is on by default, or by default depends on the data, can be turned off.
    hints = typing.get_type_hints(TrainConfig)
    for name, spec in OPTIONS.items():
        is_bool = bool in (typing.get_args(hints[name]) or (hints[name],))
        if is_bool and TrainConfig.__dataclass_fields__[name].default is not False:
            assert spec.off, name


def test_the_cli_takes_each_option_from_the_table():
    """Flag, off flag, panel, metavar and help of every train option come from OPTIONS; choices
    are the module constants other modules import, and give the metavar."""
    import typer

    from effitrain.cli.options import panels
    from effitrain.cli.train import train

    app = typer.Typer()
    app.command()(train)
    params = {p.name: p for p in typer.main.get_command(app).params}
    for name, spec in OPTIONS.items():
        assert spec.panel in HELP_PANELS and name in panels()[spec.panel], name
        param = params[name]
        assert param.opts == [spec.flag], name
        assert param.secondary_opts == ([spec.off] if spec.off else []), name
        assert param.rich_help_panel == spec.panel and param.help.startswith(spec.help), name
        if not param.is_flag:
            assert param.metavar == (spec.value_text or "N"), name
    choices = {name: spec.choices for name, spec in OPTIONS.items() if spec.choices}
    assert choices == {
        "scheduler": SCHEDULERS,
        "mixed_precision": MIXED_PRECISION,
        "weights_dtype": WEIGHTS_DTYPES,
        "chunked_loss": CHUNKED_LOSS,
        "optimizer_offload": OPTIMIZER_OFFLOAD,
        "save_strategy": SAVE_STRATEGIES,
        "preference_loss": PREFERENCE_LOSSES,
        "grpo_loss": GRPO_LOSSES,
        "scale_rewards": SCALE_REWARDS,
        "reference": REFERENCES,
        "reference_dtype": REFERENCE_DTYPES,
        "report_to": ("none", "all", *TRACKERS),
    }
    assert OPTIONS["scheduler"].value_text == "linear|cosine|constant"
    assert OPTIONS["report_to"].value_text == "NAME[,NAME]"  # its own: a list of names
    assert OPTIONS["completion_only_loss"].declaration == "--completion-only-loss/--full-loss"


@pytest.mark.parametrize("name", [name for name, spec in OPTIONS.items() if spec.choices])
def test_every_choice_is_checked_by_validate(name):
    spec = OPTIONS[name]
    bad = ["tensorboard", "bogus"] if name == "report_to" else "bogus"
    message = f"unknown {spec.flag} 'bogus'; choose one of: {', '.join(spec.choices)}"
    with pytest.raises(EffitrainError) as error:
        TrainConfig(**{name: bad}).validate()
    assert str(error.value) == message
    for value in spec.choices:  # every choice passes this check (others may refuse combinations)
        spec.check_choice([value] if name == "report_to" else value)


RESUMABLE = [
    ("--task", "causal-lm", "--full-loss", "--no-packing"),
    ("--task", "causal-lm", "--completion-only-loss", "--packing", "--chunked-loss", "torch"),
    ("--text-columns", "sentence1,sentence2", "--lr", "3e-05", "--no-memory-breakdown"),
    ("--lora-rank", "8", "--lora-target-modules", "q_lin,v_lin", "--lora-alpha", "16"),
    ("--optim", "adamw-8bit", "--fp32-embedding-state", "--scheduler", "constant"),
    ("--save-strategy", "epoch", "--save-total-limit", "2", "--report-to", "tensorboard"),
    ("--model", "tiny-llama", "--weights-dtype", "bf16", "--mixed-precision", "bf16"),
]


@pytest.mark.parametrize("options", RESUMABLE, ids=lambda options: " ".join(options))
@pytest.mark.parametrize("num_processes", [1, 2])
def test_the_resume_command_gives_the_same_config(options, num_processes, tmp_path):
    config = train_config([*options, "--output-dir", str(tmp_path / "out")])
    command = resume_command(config, num_processes)
    assert resumed(command) == dataclasses.replace(config, resume="latest"), command
    if "--full-loss" in options:
        assert "--full-loss" in shlex.split(command)
        assert "completion-only-loss" not in command  # --no-completion-only-loss does not run
    if num_processes > 1:
        assert command.startswith("accelerate launch <same launch options> -m effitrain train ")


def test_a_resumed_run_stopped_again_resumes_latest(tmp_path):
    config = train_config(
        ["--output-dir", str(tmp_path), "--resume", str(tmp_path / "checkpoint-2")]
    )
    assert resumed(resume_command(config, 1)).resume == "latest"


def test_compare_variants_take_any_train_option():
    """A variant's +option is a train flag as declared, on/off spellings included."""
    from effitrain.cli.compare import check_configuration
    from effitrain.comparison import parse_variant

    row = parse_variant("adamw +full-loss +no-packing +lora-rank=8")
    assert row.args == ["--optim", "adamw", "--full-loss", "--no-packing", "--lora-rank", "8"]
    common = to_arguments({"task": "causal-lm", "model": "tiny-llama", "max_steps": 2})
    check_configuration(row, common)
    config = train_config([*common, *row.args])
    assert (config.completion_only_loss, config.packing, config.lora_rank) == (False, False, 8)


LM_ROWS = [
    {"prompt": f"Q: what is {i} plus one?\nA:", "completion": f" {i + 1}."} for i in range(24)
]


def test_a_stopped_full_loss_run_resumes_with_the_command_it_printed(
    train_cli, tmp_path, monkeypatch
):
    """The resume command a stopped causal-LM run prints (with --full-loss, which once came out
    as the refused --no-completion-only-loss) is one effitrain train runs, and it resumes."""
    import json
    import signal

    from effitrain.signals import StopRequest

    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in LM_ROWS))
    reads = []

    def requested(self) -> bool:
        """A SIGTERM arrives during step 2 (the loop asks once per optimizer step)."""
        reads.append(1)
        if len(reads) == 2:
            self.request(signal.SIGTERM)
        return self.signum is not None

    monkeypatch.setattr(StopRequest, "requested", property(requested))
    out = tmp_path / "out"
    stopped = train_cli(
        "train", "--task", "causal-lm", "--dataset", str(data), "--full-loss", "--no-packing",
        "--max-steps", "4", "--max-length", "32", "--batch-size", "4", "--log-every", "1",
        "--no-memory-breakdown", "--output-dir", str(out),
    )  # fmt: skip
    assert stopped.returncode == 143, stopped.stdout + stopped.stderr
    (line,) = [x for x in stopped.stdout.splitlines() if x.startswith("resume with: ")]
    command = shlex.split(line.removeprefix("resume with: "))
    assert command[:2] == ["effitrain", "train"] and "--full-loss" in command, command

    monkeypatch.undo()
    resumed_run = train_cli(*command[1:])
    assert resumed_run.returncode == 0, resumed_run.stdout + resumed_run.stderr
    (checkpoint,) = [p for p in out.iterdir() if p.name.startswith("checkpoint-")]
    assert f"resumed from {checkpoint}" in resumed_run.stdout
    assert (out / "final").is_dir()


def test_a_list_option_given_twice_keeps_every_value():
    """A list option is comma-separated and repeatable: given twice, both values count (typer
    alone would keep the last one silently)."""
    config = train_config(["--text-columns", "a", "--text-columns", " b"])
    assert config.text_columns == ["a", "b"]
    grpo = ["--task", "grpo", "--reward", "r.py:one", "--reward", "r.py:two,r.py:three"]
    config = train_config([*grpo, "--reward-weights", "1", "--reward-weights", "0.2,0.3"])
    assert config.reward == ["r.py:one", "r.py:two", "r.py:three"]
    assert config.reward_weights == [1.0, 0.2, 0.3]
