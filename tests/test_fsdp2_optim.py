"""The factored optimizers on FSDP2's sharded parameters (:mod:`effitrain.optim.fsdp2`), and
every run of the suite under Accelerate's real FSDP2 on CPU processes.

One process: the sharded step, forced on plain tensors, is the library's step op for op
(bit-identical). Two processes over gloo (``fsdp2_factored.py``, real torch FSDP2): equal to one
process on the same global batch, each rank's state counted by the ledger, and checkpoints that
resume bit for bit. The same script checks the facts behind the FSDP refusals
(``fsdp_facts.py``); it runs last in the two-process launch of :func:`fsdp2_launches`, which
also holds ``effitrain train``'s FSDP2 runs (resuming across process counts, LoRA and QLoRA),
the command ``effitrain plan`` prints for FSDP2, context parallelism's two ranks, and
test_distributed.py's DDP runs: one launch's start-up for all of them (conftest's
``two_process_launch``).
"""

from __future__ import annotations

import json
import shlex
import shutil
from pathlib import Path
from types import SimpleNamespace

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


def plan_fsdp2_command() -> str:
    """The first command of a plan for two FSDP2 processes on GPUs (verified in this process,
    as conftest's session setting says)."""
    from tests.conftest import train_in_process
    from tests.test_plan import LM, ONE

    proc = train_in_process("plan", *LM, "--batch-size", "2", *ONE, "--memory", "2GiB", "--json",
                            "--num-processes", "2", "--sharding", "fsdp", "--device", "cuda")  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)["candidates"][0]["command"]


@pytest.fixture(scope="module")
def fsdp2_command(two_process_launch) -> str:
    """:func:`plan_fsdp2_command`'s, the one the shared launch ran."""
    return two_process_launch.fsdp2_command


def printed_command_run(command: str, data: list[str]) -> dict:
    """The printed FSDP2 command as a run of the launch: its ``effitrain train`` options (on
    the files of ``data``), under the launch settings its accelerate flags give (in place of the
    shipped config's, which the launch was started with: those the flags do not set are
    removed), on the CPU processes (tests/fsdp2_cpu_launch.py, in every run of the launch: FSDP
    on gloo)."""
    from tests.test_distributed import launch_environment

    words = shlex.split(command)
    module = words.index("-m")
    assert words[:2] == ["accelerate", "launch"]
    assert words[module + 1 : module + 3] == ["effitrain", "train"]
    printed = launch_environment(words[2:module])
    assert printed.get("ACCELERATE_USE_FSDP") == "true", printed
    assert words[words.index("--num_processes") + 1] == "2", command
    shipped = launch_environment(["--config_file", str(FSDP2_CONFIG), "--num_processes", "2"])
    assert printed != shipped  # else this run would not show that the flags suffice
    return {
        "name": "printed-command",
        "args": [*words[module + 2 :], "--max-memory", "2GiB", "--max-steps", "2", *data],
        "env": printed,
        # The printed command does not set ACCELERATE_USE_CPU: effitrain puts its processes on
        # the CPU itself where there are no GPUs.
        "unset": sorted({*shipped, "ACCELERATE_USE_CPU"} - set(printed)),
    }


FSDP2_CONFIG = (
    Path(__file__).resolve().parents[1] / "configs" / "accelerate" / "fsdp2-full-shard.yaml"
)


def fsdp2_launches(
    tmp_path_factory, no_dropout_model_dir: Path, lm_model_dir: Path, command: str, more: list[dict]
) -> SimpleNamespace:
    """Every run under Accelerate's FSDP2 (the shipped config, through
    ``tests/launch_runs.py``) in as few launches as their order allows, ``more`` (the DDP runs
    of test_distributed.py) in the two-process launch before ``fsdp-facts``:

    - a run without FSDP, in this process (``plain``: its checkpoint an FSDP launch refuses);
    - one process, this one (:func:`tests.launch_runs.one_rank_here`): ``one`` (adamw, 8 x 2
      accumulated, saving at step 2);
    - two processes: ``straight`` (adafactor, saving at step 2) and ``resumed`` (a copy of its
      checkpoint), ``two`` (adamw, 8 per process), ``one-to-two`` (``one``'s checkpoint, with
      ``one``'s command), ``plain-under-fsdp``; the LoRA runs of :data:`LORA_RUNS`;
      ``printed-command`` (:func:`printed_command_run`); ``context-parallel``
      (``context_parallel_ranks.py``); and last ``fsdp-facts``: torch's FSDP1 and FSDP2
      without effitrain's CLI (``fsdp2_factored.py``, which runs ``fsdp_facts.py``'s checks
      too), each rank's JSON facts in ``facts``;
    - one process, this one: ``two-to-one`` (``two``'s checkpoint, with ``two``'s command).

    The classifiers train on 128 of the demo's sentence pairs, the LoRA runs and the printed
    command on 64 of the LM demo's reports (:func:`write_reports`): the demo's thousands of
    examples, tokenized and evaluated by each rank of each run, were half of the runs' time.
    """
    from tests.conftest import train_in_process
    from tests.launch_runs import launch_runs, one_rank_here
    from tests.test_distributed import sentence_files, write_sentence_pairs

    out = tmp_path_factory.mktemp("fsdp2-runs")
    write_sentence_pairs(out)  # small files: each rank of each run tokenizes 168 pairs
    write_reports(out)
    adafactor = ["--optim", "adafactor", "--max-steps", "4", "--save-every", "2",
                 *sentence_files(out)]  # fmt: skip
    adamw = ["--model", str(no_dropout_model_dir), "--optim", "adamw", "--max-steps", "4",
             "--save-every", "2", "--batch-size", "8", "--log-every", "1", "--warmup-steps", "1",
             *sentence_files(out)]  # fmt: skip

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
    one = one_rank_here(out, train("one", adamw, "--grad-accum", "2"), FSDP2_CONFIG)
    one.assert_ran("one", codes=(0, None))
    runs = [
        train("straight", adafactor),
        resume("resumed", "straight", adafactor),
        train("two", adamw),
        resume("one-to-two", "one", adamw, "--grad-accum", "2"),
        resume("plain-under-fsdp", "plain", adamw, "--grad-accum", "2"),
        *lora_runs_of_the_launch(out, lm_model_dir),
        printed_command_run(command, report_files(out)),
        {"name": "context-parallel",
         "script": str(Path(__file__).with_name("context_parallel_ranks.py")),
         "env": {"CP_RANKS_DIR": str(out / "context-parallel")}},
        *more,
        {"name": "fsdp-facts", "script": str(Path(__file__).with_name("fsdp2_factored.py")),
         "env": {"FSDP_FACTS_DIR": str(out / "facts")}},
    ]  # fmt: skip
    (out / "facts").mkdir()
    (out / "context-parallel").mkdir()
    two = launch_runs(out, runs, config=FSDP2_CONFIG, timeout=900)
    back = one_rank_here(out, resume("two-to-one", "two", adamw), FSDP2_CONFIG)
    return SimpleNamespace(
        out=out,
        adafactor=adafactor,
        two=two,
        back=back,
        facts=out / "facts",
        lora=lora_results(out, lm_model_dir, two),
    )


@pytest.fixture(scope="module")
def fsdp2_runs(two_process_launch):
    """:func:`fsdp2_launches`' runs, run (conftest's ``two_process_launch``)."""
    return two_process_launch.fsdp2


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
    assert "Per rank: FSDP2 full shard over 1 process (gloo)" in back.stdout("two-to-one")
    straight = load_parameters(out / "two" / "final")
    expected_lr = logged_lr(two.stdout("two"))
    for name, launched in (("one-to-two", two), ("two-to-one", back)):
        assert max_abs_difference(straight, load_parameters(out / name / "final")) < 1e-5
        assert logged_lr(launched.stdout(name)) == {k: expected_lr[k] for k in (3, 4)}
    two.assert_ran("plain-under-fsdp", codes=(1, 1))
    refused = two.stderr("plain-under-fsdp")
    assert "Traceback" not in refused
    assert refused.count("was saved without FSDP") == 1, refused  # printed once, by rank 0


# --------------------------------------------------------------------------------------------
# LoRA and QLoRA under Accelerate's FSDP2, in the two-process launch of fsdp2_runs: each equals
# one process, a stopped-and-resumed run equals the uninterrupted one, only the main process
# reads the checkpoint where the launch can send the others its weights (tests/read_spy.py),
# and `estimate` says what rank 0 holds
# --------------------------------------------------------------------------------------------

# Global batch 4: two processes x 2, or one process x 4. No dropout, so that they can agree.
LORA_COMMON = (
    "--task", "causal-lm", "--lora-rank", "4", "--lora-dropout", "0", "--max-length", "64",
    "--lr", "1e-2", "--max-steps", "4", "--log-every", "1", "--seed", "3",
)  # fmt: skip
ADAM_ATOL = 1e-4
"""How far one process's trained values may be from two processes': AdamW divides each
gradient by its own size, so where a gradient is near zero the fp32 rounding of a split batch's
mean moves that element by up to a fraction of ``--lr`` (measured: one element of 1,152 at
2.6e-5 after 4 steps, the rest within 1e-6)."""
LORA_RUNS = {
    "lora": ("--save-every", "2", "--lora-merge"),
    "lora-resumed": ("--save-every", "2", "--lora-merge", "--resume", "latest"),
    "qlora": ("--load-in-4bit", "--save-every", "2"),
    "qlora-resumed": ("--load-in-4bit", "--save-every", "2", "--resume", "latest"),
    "qlora-other-base": ("--load-in-4bit", "--save-every", "2", "--resume", "latest"),
}
"""The LoRA runs of the launch, in order, by name."""
RESUMES = {"lora-resumed": "lora", "qlora-resumed": "qlora", "qlora-other-base": "qlora"}
"""The runs that restart from another's step-2 checkpoint (``qlora-other-base``: with a base
model one of whose weights differs, which the resume must refuse)."""
LLAMA_BLOCK = {"FSDP_TRANSFORMER_CLS_TO_WRAP": "LlamaDecoderLayer"}
"""The shipped config with the tiny Llama's block class to wrap (its
``fsdp_transformer_layer_cls_to_wrap`` line, as ``accelerate launch`` passes it on)."""


def write_reports(folder: Path) -> None:
    """64 of the LM demo's reports to train on (31 blocks of 64 tokens: the 4 steps of 4 stay
    in one epoch) and 16 to evaluate: no run of the launch tokenizes the demo's 3,200, and none
    generates the demo's sample (files have none)."""
    from effitrain.demo.lm import build_demo_corpus
    from tests.test_distributed import write_splits

    write_splits(folder, "reports", build_demo_corpus(num_train=64, num_validation=16))


def report_files(folder: Path) -> list[str]:
    from tests.test_distributed import split_files

    return split_files(folder, "reports")


def lora_args(model: Path, out: Path, name: str, batch_size: int, data: Path) -> list[str]:
    """The LoRA run ``name`` on :func:`write_reports`'s files in ``data``."""
    return ["train", "--quiet", "--model", str(model), *LORA_COMMON, *LORA_RUNS[name],
            *report_files(data), "--batch-size", str(batch_size), "--output-dir",
            str(out / name), "--metrics-json", str(out / f"{name}.json")]  # fmt: skip


def lora_runs_of_the_launch(out: Path, model: Path) -> list[dict]:
    """:data:`LORA_RUNS` as runs of the launch (none without peft), with ``other-base``: the
    model with one weight changed."""
    import importlib.util

    if importlib.util.find_spec("peft") is None:
        return []
    from safetensors.torch import load_file, save_file

    other = out / "other-base"
    shutil.copytree(model, other)
    weights = load_file(str(other / "model.safetensors"))
    weights["model.layers.0.self_attn.q_proj.weight"] += 0.5
    save_file(weights, str(other / "model.safetensors"), metadata={"format": "pt"})
    runs = []
    for name in LORA_RUNS:
        base = other if name == "qlora-other-base" else model
        entry = {"name": name, "args": lora_args(base, out, name, 2, out), "env": LLAMA_BLOCK}
        if name in RESUMES:
            straight = out / RESUMES[name] / "checkpoint-2"
            entry["copy"] = [str(straight), str(out / name / "checkpoint-2")]
        runs.append(entry)
    return runs


def lora_results(out: Path, model: Path, launched) -> SimpleNamespace | None:
    """What the LoRA runs left (None without peft)."""
    if not (out / "other-base").exists():
        return None
    launched.assert_ran("qlora-other-base", (1, 1))  # every process refuses
    trained = [name for name in LORA_RUNS if name != "qlora-other-base"]
    for name in trained:
        launched.assert_ran(name)
    return SimpleNamespace(
        out=out,
        model=model,
        metrics={name: json.loads((out / f"{name}.json").read_text()) for name in trained},
        refusal_output=launched.stdout("qlora-other-base") + launched.stderr("qlora-other-base"),
    )


@pytest.fixture(scope="module")
def lora_runs(fsdp2_runs):
    pytest.importorskip("peft")
    return fsdp2_runs.lora


def one_process(runs, name: str, tmp_path: Path) -> dict:
    """``name`` in this one process, with the global batch in one batch: its metrics."""
    from tests.conftest import train_in_process

    proc = train_in_process(*lora_args(runs.model, tmp_path, name, 4, runs.out))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads((tmp_path / f"{name}.json").read_text())


def losses(metrics: dict) -> list[float]:
    return [entry["loss"] for entry in metrics["loss_history"]]


def adapters(folder: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(folder / "adapter_model.safetensors"))


def assert_close(a: dict, b: dict) -> None:
    """Equal within :data:`ADAM_ATOL`, and all but a few elements (under 0.5 %) within 1e-6."""
    assert a.keys() == b.keys() and a
    total = far = 0
    for key in a:
        difference = (a[key].double() - b[key].double()).abs()
        assert float(difference.max()) <= ADAM_ATOL, key
        far += int((difference > 1e-6).sum())
        total += difference.numel()
    assert far * 200 <= total, (far, total)


@pytest.mark.slow
def test_lora_under_fsdp2_equals_one_process(lora_runs, tmp_path):
    from tests.read_spy import reads
    from tests.test_distributed import load_parameters

    two = lora_runs.metrics["lora"]
    assert two["sharding"]["kind"] == "fsdp2" and two["num_processes"] == 2
    # Rank 1 started on the meta device and opened no file of the model: Accelerate filled its
    # shards from rank 0's.
    assert [r["weights"] for r in two["ranks"]] == ["read", "from rank 0"]
    model_file = str(lora_runs.model / "model.safetensors")
    assert reads(lora_runs.out, 0, "lora") == [model_file]
    assert reads(lora_runs.out, 1, "lora") == []
    # Sharded: each rank holds its own half, not a copy.
    checksums = [r["parameter_checksum"] for r in two["ranks"]]
    assert checksums[0] != checksums[1]

    one = one_process(lora_runs, "lora", tmp_path)
    assert losses(two) == pytest.approx(losses(one), abs=1e-5)
    assert losses(one)[-1] < losses(one)[0]
    trained = adapters(lora_runs.out / "lora" / "final")
    assert_close(trained, adapters(tmp_path / "lora" / "final"))
    assert max(float(t.abs().max()) for k, t in trained.items() if "lora_B" in k) > 1e-2
    # --lora-merge gathers the sharded base and adapters into one plain model.
    # (The gathered state dict has lost the tie: the head is written too, equal to the
    # embedding it is tied to again on loading.)
    merged = load_parameters(lora_runs.out / "lora" / "final-merged")
    assert torch.equal(merged.pop("lm_head.weight"), merged["model.embed_tokens.weight"])
    assert_close(merged, load_parameters(tmp_path / "lora" / "final-merged"))


@pytest.mark.slow
def test_lora_under_fsdp2_resumes_exactly(lora_runs):
    from tests.checkpoint_helpers import assert_identical

    straight, resumed = lora_runs.metrics["lora"], lora_runs.metrics["lora-resumed"]
    assert resumed["global_steps"] == 4
    assert len(losses(straight)) == 4 and losses(resumed) == losses(straight)
    assert [r["parameter_checksum"] for r in resumed["ranks"]] == [
        r["parameter_checksum"] for r in straight["ranks"]
    ]
    out = lora_runs.out
    assert_identical(adapters(out / "lora" / "final"), adapters(out / "lora-resumed" / "final"))


@pytest.mark.slow
def test_qlora_under_fsdp2_equals_one_process_and_resumes_exactly(lora_runs, tmp_path):
    from tests.checkpoint_helpers import assert_identical
    from tests.read_spy import reads

    two = lora_runs.metrics["qlora"]
    # Every process reads and quantizes: bitsandbytes' quant state is no parameter or buffer
    # that the launch could send.
    assert [r["weights"] for r in two["ranks"]] == ["read", "read"]
    model_file = str(lora_runs.model / "model.safetensors")
    assert reads(lora_runs.out, 1, "qlora") == [model_file]

    one = one_process(lora_runs, "qlora", tmp_path)
    assert losses(two) == pytest.approx(losses(one), abs=1e-5)
    assert_close(
        adapters(lora_runs.out / "qlora" / "final"), adapters(tmp_path / "qlora" / "final")
    )
    # Each rank holds half of the packed codes (stored as bf16 so that FSDP2 shards them) and
    # the whole quant state.
    rank0, rank1 = (r["parameter_bytes"] for r in two["ranks"])
    assert rank0 == rank1 < one["ranks"][0]["parameter_bytes"]

    resumed = lora_runs.metrics["qlora-resumed"]
    assert [r["parameter_checksum"] for r in resumed["ranks"]] == [
        r["parameter_checksum"] for r in two["ranks"]
    ]
    out = lora_runs.out
    assert_identical(adapters(out / "qlora" / "final"), adapters(out / "qlora-resumed" / "final"))
    # Each rank compares its shard of the sharded checkpoint's 4-bit codes with the ones it
    # quantized: another base is refused in one line, by every process.
    refusal = "layers.0.self_attn.q_proj.base_layer.weight differs from the one quantized"
    errors = [line for line in lora_runs.refusal_output.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and refusal in errors[0], errors


@pytest.mark.slow
@pytest.mark.parametrize("name", ["lora", "qlora"])
def test_estimate_says_what_rank_0_holds(lora_runs, name):
    """``estimate --num-processes 2 --sharding fsdp`` gives rank 0's measured parameters (the
    frozen base and the adapters split by rows; the 4-bit quant state whole) and optimizer
    state, to the byte."""
    from effitrain.cli.compare import train_config
    from effitrain.distributed import Launch
    from effitrain.estimation import estimate

    args = lora_args(lora_runs.model, lora_runs.out / "estimate", name, 2, lora_runs.out)[2:]
    config = train_config([a for a in args if a not in ("--resume", "latest")])
    per_rank = estimate(config, Launch.described(2, "fsdp", "cpu")).per_device
    rank0 = lora_runs.metrics[name]["ranks"][0]
    assert per_rank.parameter_bytes == rank0["parameter_bytes"]
    assert per_rank.optimizer_state_bytes == rank0["optimizer_state_bytes"]


# --------------------------------------------------------------------------------------------
# `effitrain plan` for two FSDP2 processes: the printed command, run in the launch
# --------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_the_plan_prints_fsdp2_launch_flags(fsdp2_command):
    assert fsdp2_command.startswith(
        "accelerate launch --num_processes 2 --use_fsdp --fsdp_version 2 "
        "--fsdp_reshard_after_forward true --fsdp_auto_wrap_policy TRANSFORMER_BASED_WRAP "
        "--fsdp_state_dict_type SHARDED_STATE_DICT -m effitrain train "
    ), fsdp2_command


@pytest.mark.slow
def test_the_fsdp2_command_shards_the_run(fsdp2_runs):
    """The printed FSDP2 command's ``effitrain train``, under the launch settings of its
    accelerate flags as printed (:func:`printed_command_run`), on two CPU processes: the run is
    FSDP2's full shard (the command without them trained unsharded)."""
    fsdp2_runs.two.assert_ran("printed-command")
    assert "FSDP2 full shard over 2 processes" in fsdp2_runs.two.stdout("printed-command")


# --------------------------------------------------------------------------------------------
# Context parallelism on two ranks over gloo (context_parallel_ranks.py, in the launch)
# --------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_two_cp_ranks_on_gloo(fsdp2_runs):
    """Rank r holds chunks r and 3-r of 4 (Accelerate's load balance), each token with its true
    position and the label of the token after it; the two ranks' loss and gradient equal one
    process's token mean over the whole batch."""
    from effitrain.tasks.lm_loss import shifted_labels
    from tests.context_parallel_ranks import example

    fsdp2_runs.two.assert_ran("context-parallel")
    folder = fsdp2_runs.out / "context-parallel"
    ranks = [torch.load(folder / f"rank{r}.pt") for r in (0, 1)]
    ids, labels, embed, head = example()
    shifted = shifted_labels(labels)  # the causal-LM loss's shift
    for rank, got in enumerate(ranks):
        chunks = [rank, 3 - rank]
        positions = torch.cat([torch.arange(2 * c, 2 * c + 2) for c in chunks])
        assert not got["mask"]
        assert torch.equal(got["positions"], positions.repeat(2, 1))
        assert torch.equal(got["ids"], ids[:, positions])
        assert torch.equal(got["shift_labels"], shifted[:, positions])
    loss = torch.nn.functional.cross_entropy(
        head(embed(ids)).flatten(0, 1), shifted.flatten(), ignore_index=-100
    )
    loss.backward()
    for got in ranks:
        torch.testing.assert_close(got["loss"], loss.detach())
        torch.testing.assert_close(got["grad"], head.weight.grad)
