"""The factored optimizers on FSDP2's sharded parameters (:mod:`effitrain.optim.fsdp2`).

One process: the sharded step, forced on plain tensors, is the library's step op for op
(bit-identical). Two processes over gloo (``fsdp2_factored.py``, real torch FSDP2): equal to one
process on the same global batch, each rank's state counted by the ledger, and checkpoints that
resume bit for bit. The same script checks the facts behind the FSDP refusals
(``fsdp_facts.py``); it runs last in the two-process launch of :func:`fsdp2_runs`.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from effitrain import optim
from effitrain.distributed import (
    DTENSOR_INCOMPATIBLE,
    FACTORED_OPTIMIZERS,
    replicated_under_fsdp2,
)

pytest.importorskip("pytorch_optimizer")

SHAPES = [(7,), (5, 3), (1, 9), (4, 3, 6), (2, 3, 4, 5)]
"""1-D (no factoring), 2-D (column factor replicated under FSDP2), a one-row weight, 3-D and 4-D
(both factors sharded)."""


def library_and_sharded(name: str, options: dict):
    from pytorch_optimizer import CAME
    from transformers.optimization import Adafactor as AdafactorHF

    from effitrain.optim import fsdp2

    library = {"adafactor": torch.optim.Adafactor, "adafactor-hf": AdafactorHF, "came": CAME}
    return library[name], fsdp2.sharded_class(name)


CASES = [
    ("adafactor", {"lr": 1e-2, "weight_decay": 0.1}),
    ("adafactor", {"lr": 1e-2, "maximize": True, "d": 2.0}),
    (
        "adafactor-hf",
        {"lr": 1e-3, "relative_step": False, "scale_parameter": False, "weight_decay": 0.1},
    ),
    ("adafactor-hf", {"lr": None, "beta1": 0.9}),  # relative step, parameter scaling, momentum
    ("came", {"lr": 1e-3, "weight_decay": 0.1}),
    ("came", {"lr": 1e-3, "ams_bound": True, "maximize": True}),
    ("came", {"lr": 1e-3, "foreach": False, "weight_decouple": False, "weight_decay": 0.1}),
]


@pytest.mark.parametrize(("name", "options"), CASES)
def test_the_sharded_step_is_the_library_step_on_one_process(name, options):
    library, sharded = library_and_sharded(name, options)
    torch.manual_seed(0)
    ps = [torch.nn.Parameter(torch.randn(shape)) for shape in SHAPES]
    qs = [torch.nn.Parameter(p.detach().clone()) for p in ps]
    reference, mine = library(ps, **options), sharded(qs, **options)
    mine.force_sharded_step = True
    for _ in range(4):
        for p, q in zip(ps, qs, strict=True):
            p.grad = torch.randn(p.shape)
            q.grad = p.grad.clone()
        reference.step()
        mine.step()
    for p, q in zip(ps, qs, strict=True):
        assert torch.equal(p, q)
        assert reference.state[p].keys() == mine.state[q].keys()
        for key, value in reference.state[p].items():
            if torch.is_tensor(value):
                assert torch.equal(value, mine.state[q][key]), key
    assert reference.param_groups[0].keys() == mine.param_groups[0].keys()


@pytest.mark.parametrize("name", sorted(FACTORED_OPTIMIZERS))
def test_plain_parameters_take_the_library_step(name, monkeypatch):
    """Without DTensors the class is the library's: its own step runs, not effitrain's."""
    _, sharded = library_and_sharded(name, {})
    p = torch.nn.Parameter(torch.randn(4, 3))
    optimizer = optim.for_sharding(optim.get_spec(name), True).factory([{"params": [p]}], 1e-3)
    assert isinstance(optimizer, sharded)
    monkeypatch.setattr(type(optimizer), "_sharded_group", None)  # would raise if called
    p.grad = torch.randn(4, 3)
    optimizer.step()


@pytest.mark.parametrize("name", sorted(FACTORED_OPTIMIZERS))
def test_under_fsdp2_the_registry_builds_the_sharded_class_with_its_hyperparameters(name):
    spec = optim.get_spec(name)
    assert optim.for_sharding(spec, False) is spec
    variant = optim.for_sharding(spec, True)
    assert variant.name == name and "effitrain.optim.fsdp2" in variant.class_path
    assert spec.class_path in variant.class_path
    p = torch.nn.Parameter(torch.randn(4, 3))
    library = spec.factory([{"params": [p]}], 1e-3)
    built = variant.factory([{"params": [p]}], 1e-3)
    assert isinstance(built, type(library))
    assert built.defaults == library.defaults
    assert optim.for_sharding(optim.get_spec("adamw"), True).class_path == "torch.optim.AdamW"


def test_which_state_fsdp2_replicates():
    assert replicated_under_fsdp2("col_var", 2) and replicated_under_fsdp2("exp_avg_res_col", 2)
    assert not replicated_under_fsdp2("col_var", 3)  # its dim 0 is the weight's dim 0
    assert not replicated_under_fsdp2("row_var", 2) and not replicated_under_fsdp2("exp_avg", 2)


# --------------------------------------------------------------------------------------------
# Two processes, real FSDP2 over gloo
# --------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_fsdp_facts_behind_the_rules(fsdp2_runs):
    """Real FSDP1/FSDP2 on two CPU processes: the behaviour the refusals and notes describe."""
    fsdp2_runs.two.assert_ran("fsdp-facts")
    facts = [json.loads(p.read_text()) for p in sorted(fsdp2_runs.facts.glob("rank-*.json"))]
    assert len(facts) == 2  # one file per rank
    for rank_facts in facts:
        # FSDP2: the DTensor-incompatible optimizers crash, AdamW trains.
        # (torchao's two are left out: each compiles its step for a minute on a CPU;
        # docs/distributed.md says how they fare.)
        # The libraries' factored optimizers crash too: effitrain replaces them under FSDP2
        # (effitrain.optim.fsdp2, tested by test_fsdp2_optim.py).
        crash = (set(DTENSOR_INCOMPATIBLE) | FACTORED_OPTIMIZERS) - {
            "adamw-4bit",
            "adamw-fp8",
        }
        for name in crash:
            assert rank_facts["fsdp2"][name] == "crash", rank_facts
        assert rank_facts["fsdp2"]["adamw"] == "trains"
        # Element-wise, plain torch: Lion (lion-pytorch) and schedule-free AdamW train.
        assert rank_facts["fsdp2"]["lion"] == rank_facts["fsdp2"]["adamw-schedule-free"] == "trains"
        # FSDP1, use_orig_params=True: 1-D shards, so Adafactor keeps a full `variance`.
        assert rank_facts["fsdp1"]["adafactor"] == ["step", "variance"]
        assert rank_facts["fsdp1"]["came"] == ["RMS", "exp_avg", "exp_avg_sq"]  # not factored
        assert rank_facts["fsdp1"]["param_dims"] == [1]
        # FSDP1, use_orig_params=False, optimizer built before wrapping: nothing trains.
        assert rank_facts["fsdp1"]["orig_params_false_trains"] is False
        # Adam-mini: FSDP2's row shards give exactly one process's result; FSDP1's 1-D crash.
        mini = rank_facts["adam-mini"]
        assert mini["fsdp2_max_diff"] == 0.0 and mini["fsdp2_moved"] > 1e-3, mini
        assert mini["fsdp1"] == "IndexError"


@pytest.mark.slow
def test_two_fsdp2_processes_equal_one_and_resume_exactly(fsdp2_runs):
    fsdp2_runs.two.assert_ran("fsdp-facts")
    facts_dir = fsdp2_runs.facts
    ranks = [json.loads(p.read_text()) for p in sorted(facts_dir.glob("factored-rank-*.json"))]
    assert len(ranks) == 2
    for name in FACTORED_OPTIMIZERS:
        facts = [rank["optimizers"][name] for rank in ranks]
        for rank, fact in enumerate(facts):
            # After every step, the gathered weights are one process's, to fp32 rounding
            # (the reductions add in another order), while training moved them by ~0.1.
            assert max(fact["param_max_diff_per_step"]) < 1e-6, (name, fact)
            assert fact["moved"] > 0.05, (name, fact)
            assert fact["state_max_diff"] < 1e-5, (name, fact)
            # The ledger counts this rank's rows of every sharded tensor and the whole column
            # factors of 2-D weights: the arithmetic of fsdp2_factored.expected_rank_bytes.
            assert fact["rank_state_bytes"] == fact["expected_rank_state_bytes"], (name, rank)
            for kind, checkpoint in fact["checkpoint"].items():
                assert checkpoint["bit_identical"], (name, kind, checkpoint)
        # HSDP (a 2-D mesh: replicas x shards), sharded over 2 and replicated over 2.
        for shape, diff in facts[0]["hsdp_max_diff"].items():
            assert diff < 1e-6, (name, shape, diff)
        # effitrain estimate's FSDP2 split says rank 0's, the largest share, to the byte.
        assert facts[0]["estimated_rank0_state_bytes"] == facts[0]["rank_state_bytes"], name
        # Uneven and empty shards: 11 rows split 6 + 5, the one-row weight 1 + 0.
        assert [f["local_rows"]["embed.weight"] for f in facts] == [6, 5]
        assert [f["local_rows"]["offset"] for f in facts] == [1, 0]
        # Each rank holds less than one process, together more (the column factors).
        one = facts[0]["one_process_state_bytes"]
        assert all(f["rank_state_bytes"] < one for f in facts), facts
        assert sum(f["rank_state_bytes"] for f in facts) > one


def test_only_fsdp2_placements_are_accepted():
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import Partial

    from effitrain.optim.fsdp2 import ShardingError, sharded_mesh_dim

    assert sharded_mesh_dim((Shard(0),)) == 0
    assert sharded_mesh_dim((Replicate(), Shard(0))) == 1  # HSDP: replicate, then shard
    assert sharded_mesh_dim((Replicate(),)) is None
    for placements in [(Shard(1),), (Partial(),), (Shard(0), Shard(0))]:
        with pytest.raises(ShardingError):
            sharded_mesh_dim(placements)


# --------------------------------------------------------------------------------------------
# Through effitrain: `effitrain train` under Accelerate's FSDP2 (fsdp2_cpu_launch.py lets
# Accelerate choose FSDP on CPU processes; everything else is the shipped code and config)
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def fsdp2_runs(tmp_path_factory, no_dropout_model_dir):
    """Every ``effitrain train`` run under Accelerate's FSDP2 (the shipped config, through
    ``tests/launch_runs.py``) in as few launches as their order allows:

    - a run without FSDP, in this process (``plain``: its checkpoint an FSDP launch refuses);
    - one process: ``one`` (adamw, 8 x 2 accumulated, saving at step 2);
    - two processes: ``straight`` (adafactor, saving at step 2) and ``resumed`` (a copy of its
      checkpoint), ``two`` (adamw, 8 per process), ``one-to-two`` (``one``'s checkpoint, with
      ``one``'s command), ``plain-under-fsdp``, and last ``fsdp-facts``: torch's FSDP1 and FSDP2
      without effitrain's CLI (``fsdp2_factored.py``, which runs ``fsdp_facts.py``'s checks
      too), each rank's JSON facts in ``facts``;
    - one process: ``two-to-one`` (``two``'s checkpoint, with ``two``'s command).
    """
    from types import SimpleNamespace

    from tests.conftest import train_in_process
    from tests.launch_runs import launch_runs
    from tests.test_distributed import REPO

    out = tmp_path_factory.mktemp("fsdp2-runs")
    config = REPO / "configs" / "accelerate" / "fsdp2-full-shard.yaml"
    adafactor = ["--optim", "adafactor", "--max-steps", "4", "--save-every", "2"]
    adamw = ["--model", str(no_dropout_model_dir), "--optim", "adamw", "--max-steps", "4",
             "--save-every", "2", "--batch-size", "8", "--log-every", "1", "--warmup-steps", "1"]  # fmt: skip

    def train(name: str, options: list[str], *extra: str) -> dict:
        run = ["train", *options, "--output-dir", str(out / name), "--metrics-json",
               str(out / f"{name}.json"), *extra]  # fmt: skip
        return {"name": name, "args": run}

    def resume(name: str, source: str, options: list[str], *extra: str) -> dict:
        copy = [str(out / folder / "checkpoint-2") for folder in (source, name)]
        return {**train(name, options, *extra, "--resume", "latest"), "copy": copy}

    plain = train_in_process(
        *train("plain", adamw, "--grad-accum", "2", "--max-steps", "2")["args"]
    )
    assert plain.returncode == 0, plain.stdout + plain.stderr
    one = launch_runs(out, [train("one", adamw, "--grad-accum", "2")], config=config, processes=1)
    one.assert_ran("one", codes=(0, None))
    runs = [
        train("straight", adafactor),
        resume("resumed", "straight", adafactor),
        train("two", adamw),
        resume("one-to-two", "one", adamw, "--grad-accum", "2"),
        resume("plain-under-fsdp", "plain", adamw, "--grad-accum", "2"),
        {"name": "fsdp-facts", "script": str(Path(__file__).with_name("fsdp2_factored.py")),
         "env": {"FSDP_FACTS_DIR": str(out / "facts")}},
    ]  # fmt: skip
    (out / "facts").mkdir()
    two = launch_runs(out, runs, config=config, timeout=400)
    back = launch_runs(out, [resume("two-to-one", "two", adamw)], config=config, processes=1)
    return SimpleNamespace(out=out, adafactor=adafactor, two=two, back=back, facts=out / "facts")


@pytest.mark.slow
def test_effitrain_trains_adafactor_under_fsdp2_and_resumes_bit_for_bit(fsdp2_runs):
    """The straight run saving at step 2, then a copy of that checkpoint resumed, in one
    launch."""
    from effitrain.cli.compare import train_config
    from effitrain.distributed import Launch
    from effitrain.estimation import estimate
    from tests.test_distributed import load_parameters

    out, launched, args = fsdp2_runs.out, fsdp2_runs.two, fsdp2_runs.adafactor
    launched.assert_ran("straight")
    straight = json.loads((out / "straight.json").read_text())
    assert "Per rank: FSDP2 full shard over 2 processes (gloo)" in launched.stdout("straight")
    assert straight["sharding"]["kind"] == "fsdp2"
    assert "effitrain.optim.fsdp2" in straight["optimizer_class"]
    assert set(straight["optimizer_state"]["by_key"]) == {"step", "row_var", "col_var", "variance"}
    # Rank 0 holds what `effitrain estimate --num-processes 2 --sharding fsdp` says, to the byte.
    launch_described = Launch.described(2, "fsdp", "cpu")
    predicted = estimate(train_config([*args, "--output-dir", str(out)]), launch_described)
    predicted = predicted.per_device
    rank0 = straight["ranks"][0]
    assert rank0["optimizer_state_bytes"] == predicted.optimizer_state_bytes
    assert rank0["parameter_bytes"] == predicted.parameter_bytes

    launched.assert_ran("resumed")
    after = json.loads((out / "resumed.json").read_text())
    assert [r["parameter_checksum"] for r in after["ranks"]] == [
        r["parameter_checksum"] for r in straight["ranks"]
    ]
    a = load_parameters(out / "straight" / "final")
    b = load_parameters(out / "resumed" / "final")
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
def test_fsdp2_resumes_on_another_process_count(fsdp2_runs):
    """FSDP2's sharded checkpoint (torch.distributed.checkpoint) resharded on load, 1 -> 2 and
    2 -> 1 processes, each resume run with the command of the run it continues: the global
    batch kept by the accumulation, the lr schedule continued, and the weights of the
    uninterrupted two-process run within 1e-5 (dropout off: one process draws the two
    processes' micro-batches' dropout masks from one random stream). A checkpoint saved
    without FSDP is refused by an FSDP launch in one line."""
    from tests.test_distributed import load_parameters, logged_lr, max_abs_difference

    out, two, back = fsdp2_runs.out, fsdp2_runs.two, fsdp2_runs.back
    two.assert_ran("two")
    two.assert_ran("one-to-two")
    back.assert_ran("two-to-one", codes=(0, None))
    assert "has 2: --grad-accum 1 keeps its global batch of 16" in two.stdout("one-to-two")
    assert "has 1: --grad-accum 2 keeps its global batch of 16" in back.stdout("two-to-one")
    straight = load_parameters(out / "two" / "final")
    expected_lr = logged_lr(two.stdout("two"))
    for name, launched in (("one-to-two", two), ("two-to-one", back)):
        assert max_abs_difference(straight, load_parameters(out / name / "final")) < 1e-5
        assert logged_lr(launched.stdout(name)) == {k: expected_lr[k] for k in (3, 4)}
    two.assert_ran("plain-under-fsdp", codes=(1, 1))
    refused = two.stderr("plain-under-fsdp")
    assert "Traceback" not in refused
    assert refused.count("was saved without FSDP") == 1, refused  # printed once, by rank 0
