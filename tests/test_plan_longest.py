"""``effitrain plan --max-length longest``: the search over lengths, its answer checked through
the estimate, its JSON and table, and the refusals."""

from __future__ import annotations

import json

import pytest

from tests.conftest import assert_clean_error


def _every_searched_lever() -> str:
    import effitrain.levers as levers

    return ",".join(
        lever.name
        for lever in levers.LEVERS.values()
        if lever.search is not None and not lever.trains_adapters
    )


ONE = ["--full-parameter", "--optim", "adamw", "--without", _every_searched_lever()]
"""One lever set (the chunked loss, on by default), one optimizer: two estimates a length."""


@pytest.mark.parametrize("bytes_per_token", [1000, 37_000, 250_000])
@pytest.mark.parametrize("quadratic", [0, 3])
def test_lengths_found_are_the_longest_on_the_grid(bytes_per_token, quadratic):
    """For a line and a parabola the answer fits, the next length on the grid does not, the
    answer is on the grid, and few lengths are tried: for a line, two to draw it, then its
    crossing's two grid neighbours (one more where the growth cap stops the line short)."""
    from effitrain.plan_lengths import longest_fitting, round_down, step_at

    room = 8 * 2**30

    def peak(length: int) -> int:
        return 2**30 + bytes_per_token * length + quadratic * length**2

    found = longest_fitting(peak, room, cap=2**24)
    assert found.length is not None and found.length == round_down(found.length)
    assert peak(found.length) <= room < peak(found.length + step_at(found.length))
    assert found.over == found.length + step_at(found.length)
    assert len(found.peaks) <= (7 if quadratic else 5), sorted(found.peaks)


def test_lengths_capped_and_nothing_fits():
    from effitrain.plan_lengths import SHORTEST, longest_fitting

    found = longest_fitting(lambda length: length, 10**9, cap=1000)
    assert (found.length, found.over) == (1000, None)  # the cap itself, off the grid
    nothing = longest_fitting(lambda length: 10**6 + length, 10**5, cap=2**24)
    assert nothing.length is None and min(nothing.peaks) == SHORTEST
    assert len(nothing.peaks) == 2


def test_longest_on_the_command_line(train_cli, monkeypatch, tmp_path):
    """--max-length longest (or the YAML's max_length: longest) runs the longest search with
    batch 1 unless one is given, and --json carries its answer; a number still plans at it."""
    import effitrain.planning
    from effitrain.results import PlanResult

    seen = []

    def plan(config, *args, longest=False, **kwargs):
        seen.append((config, longest))
        return PlanResult(1, 0, "cpu", [], 0, 0, 0.0, longest=4096 if longest else None)

    monkeypatch.setattr(effitrain.planning, "plan", plan)
    base = ["plan", "--task", "causal-lm", "--memory", "1GiB", "--json"]
    proc = train_cli(*base, "--max-length", "longest")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["longest"] == 4096
    assert seen[-1][0].batch_size == 1 and seen[-1][1]
    config_file = tmp_path / "long.yaml"
    config_file.write_text("max_length: longest\nbatch_size: 4\n")
    proc = train_cli(*base, "--config", str(config_file))
    assert proc.returncode == 0, proc.stderr
    assert seen[-1][0].batch_size == 4 and seen[-1][1]
    proc = train_cli(*base, "--config", str(config_file), "--max-length", "256")
    assert proc.returncode == 0, proc.stderr
    assert seen[-1][0].max_length == 256 and not seen[-1][1]


def test_longest_means_nothing_to_train_or_estimate(train_cli, tmp_path):
    """Only the plan searches lengths: train and estimate refuse the word in one line, as the
    plan refuses a value that is neither a number nor the word."""
    for command in ("train", "estimate"):
        proc = train_cli(command, "--task", "causal-lm", "--max-length", "longest")
        assert_clean_error(proc, "--max-length")
    config_file = tmp_path / "long.yaml"
    config_file.write_text("max_length: longest\n")
    proc = train_cli("estimate", "--task", "causal-lm", "--config", str(config_file))
    assert_clean_error(proc, "'max_length' must be an integer")
    proc = train_cli("plan", "--task", "causal-lm", "--memory", "1GiB", "--max-length", "lots")
    assert_clean_error(proc, "--max-length lots: give a number of tokens, or longest")


@pytest.mark.slow
def test_the_longest_fits_and_one_step_more_does_not():
    """On tiny-llama: the answer's length fits the budget by a full estimate of its command and
    a length one step longer does not; its args and table say it. It is past the model's
    2,048 positions (rotary): the command says --beyond-positions, and a note why."""
    from rich.console import Console

    from effitrain.cli.compare import train_config
    from effitrain.distributed import Launch
    from effitrain.estimation import estimate
    from effitrain.plan_lengths import step_at
    from effitrain.planning import plan
    from effitrain.report.plan_table import print_plan

    options = ["--task", "causal-lm", "--model", "tiny-llama", "--no-packing", "--batch-size", "1"]
    budget = 160 * 2**20
    launch = Launch.described(1, "ddp", "cpu")
    result = plan(
        train_config(options), launch, budget, workers=0, full_parameter=True,
        optimizers=["adamw"], without=ONE[-1].split(","), longest=True,
    )  # fmt: skip
    length = result.longest
    assert length is not None and length > 2048 and result.candidates
    best = result.candidates[0]
    assert best.verified and best.args[best.args.index("--max-length") + 1] == str(length)
    assert "--beyond-positions" in best.args
    assert any("beyond the model's 2,048 positions" in note for note in result.notes)
    config = train_config([*options, *best.args])
    assert estimate(config, launch).memory.peak_tensor_bytes <= budget
    longer = train_config([*options, *best.args, "--max-length", str(length + step_at(length))])
    assert estimate(longer, launch).memory.peak_tensor_bytes > budget
    assert result.to_dict()["longest"] == length
    console = Console(record=True, width=200)
    print_plan(result, console)
    assert f"the longest sequence that fits: {length:,} tokens" in console.export_text()


@pytest.mark.slow
def test_beyond_positions_trains_past_them(train_cli, long_text_file, tmp_path):
    """tiny-llama takes 2,048 positions: with --beyond-positions a run trains on 4,096-token
    blocks (without, they are cut); a learned table of positions refuses it in one line."""
    metrics = tmp_path / "metrics.json"
    proc = train_cli("train", "--task", "causal-lm", "--model", "tiny-llama", "--train-file",
                     str(long_text_file), "--max-length", "4096", "--beyond-positions",
                     "--batch-size", "1", "--max-steps", "1", "--metrics-json", str(metrics))  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    result = json.loads(metrics.read_text())
    assert result["tokens_per_second"] * result["seconds_per_step"] == pytest.approx(4096)
    proc = train_cli("estimate", "--model", "tiny", "--beyond-positions")
    assert_clean_error(proc, "--beyond-positions: tiny learns a table of positions")


@pytest.mark.slow
def test_nothing_fits_even_short(train_cli, long_lm_model_dir):
    proc = train_cli("plan", "--task", "causal-lm", "--model", str(long_lm_model_dir),
                     "--max-length", "longest", *ONE, "--memory", "1MiB")  # fmt: skip
    assert_clean_error(proc, "nothing fits 1.0 MiB per device even at 128 tokens", "over")
