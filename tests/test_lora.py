"""LoRA through peft (``--lora-rank``): what trains, what is saved, exact resume, refusals.

End to end on the checkpoint tests' tiny model folder (DistilBERT with dropout 0.1, so LoRA's own
dropout and the model's come back on resume); unit tests for the choice of target modules and
head on DistilBERT and BERT (all-linear by default; query, value when asked).
"""

from __future__ import annotations

import json
import shutil
from types import SimpleNamespace

import pytest

from tests.checkpoint_helpers import assert_identical, load_tensors, train_args
from tests.conftest import assert_clean_error, hide_package, train_in_process

pytest.importorskip("peft")

LORA = ("--lora-rank", "4")


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory, data):
    """One 6-step LoRA run with --lora-merge, saving at steps 3 and 6."""
    folder = tmp_path_factory.mktemp("lora")
    out, metrics = folder / "out", folder / "metrics.json"
    options = (*LORA, "--max-steps", "6", "--save-every", "3", "--lora-merge")
    proc = train_in_process(*train_args(data, out, *options), "--metrics-json", str(metrics))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return SimpleNamespace(
        data=data, out=out, proc=proc, metrics=json.loads(metrics.read_text()), options=options
    )


def tiny_distilbert():
    from effitrain.models import load_model, load_tokenizer

    return load_model("tiny", ["no", "yes"], load_tokenizer("tiny"))


def tiny_bert():
    from transformers import BertConfig, BertForSequenceClassification

    config = BertConfig(
        vocab_size=100,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        num_labels=3,
    )
    return BertForSequenceClassification(config)


def lora_config(**values):
    from effitrain.build import check_config
    from effitrain.config import TrainConfig

    return check_config(TrainConfig(**values).validate())


def trainable_names(model) -> list[str]:
    return [name for name, p in model.named_parameters() if p.requires_grad]


# --------------------------------------------------------------------------------------------
# What trains
# --------------------------------------------------------------------------------------------


def test_distilbert_gets_all_linear_layers_and_its_two_head_layers_train():
    from effitrain.levers import apply_to_model, banner_lines

    model = apply_to_model(tiny_distilbert(), lora_config(lora_rank=4))
    names = trainable_names(model)
    adapted = {n.split(".lora_")[0].rsplit(".", 1)[-1] for n in names if ".lora_" in n}
    # Every Linear layer outside the head.
    assert adapted == {"q_lin", "k_lin", "v_lin", "out_lin", "lin1", "lin2"}
    head = [n for n in names if ".lora_" not in n]
    assert head == [
        "base_model.model.pre_classifier.modules_to_save.default.weight",
        "base_model.model.pre_classifier.modules_to_save.default.bias",
        "base_model.model.classifier.modules_to_save.default.weight",
        "base_model.model.classifier.modules_to_save.default.bias",
    ]
    (line,) = banner_lines(lora_config(lora_rank=4), model)
    assert line.startswith("LoRA r=4 alpha=8 (2 x rank) dropout 0.05 on q_lin, k_lin, v_lin")
    assert "(all linear layers, the default)" in line
    assert "head pre_classifier, classifier trains in full" in line


def test_bert_gets_all_linear_by_default_or_the_given_modules_and_its_pooler_trains():
    from effitrain.levers import apply_to_model, banner_lines

    model = apply_to_model(tiny_bert(), lora_config(lora_rank=2))
    adapted = {
        n.split(".lora_")[0].rsplit(".", 1)[-1] for n in trainable_names(model) if ".lora_" in n
    }
    assert adapted == {"query", "key", "value", "dense"}  # attention and feed-forward Linears

    config = lora_config(
        lora_rank=2, lora_alpha=4.0, lora_dropout=0.0, lora_target_modules=["query", "value"]
    )
    model = apply_to_model(tiny_bert(), config)
    names = trainable_names(model)
    adapted = {n.split(".lora_")[0].rsplit(".", 1)[-1] for n in names if ".lora_" in n}
    assert adapted == {"query", "value"}
    # The pooler feeds the classifier only: it trains with it (peft alone would freeze it).
    assert [n for n in names if ".lora_" not in n] == [
        "base_model.model.bert.pooler.modules_to_save.default.dense.weight",
        "base_model.model.bert.pooler.modules_to_save.default.dense.bias",
        "base_model.model.classifier.modules_to_save.default.weight",
        "base_model.model.classifier.modules_to_save.default.bias",
    ]
    (line,) = banner_lines(config, model)
    assert "LoRA r=2 alpha=4 dropout 0 on query, value (--lora-target-modules)" in line
    assert "head bert.pooler, classifier trains in full" in line


def test_memory_counts_only_adapters_and_head():
    from effitrain.levers import apply_to_model
    from effitrain.memory import ledger

    model = apply_to_model(tiny_distilbert(), lora_config(lora_rank=4))
    trainable = [p for p in model.parameters() if p.requires_grad]
    count = sum(p.numel() for p in trainable)
    assert ledger.trainable_parameter_count(model) == count
    assert count < sum(p.numel() for p in model.parameters()) / 5
    assert ledger.adamw_equivalent_elements(model) == 2 * count + len(trainable)
    assert ledger.adamw_equivalent_bytes(model) == 4 * (2 * count + len(trainable))


def test_given_target_modules_get_adapters():
    from effitrain.levers import apply_to_model

    config = lora_config(lora_rank=4, lora_target_modules=["q_lin", "v_lin"])
    model = apply_to_model(tiny_distilbert(), config)
    names = trainable_names(model)
    adapted = {n.split(".lora_")[0].rsplit(".", 1)[-1] for n in names if ".lora_" in n}
    assert adapted == {"q_lin", "v_lin"}


# --------------------------------------------------------------------------------------------
# End to end: banner, metrics, final adapters, merged model, inspect-state
# --------------------------------------------------------------------------------------------


def test_banner_and_metrics_show_only_adapters_and_head_train(lora_run):
    assert "  lever     LoRA r=4 alpha=8 (2 x rank) dropout 0.05 on q_lin" in lora_run.proc.stdout
    # Pretrained weights (a folder) with nothing but --lora-rank: AdamW's LoRA default.
    assert "lr 0.002 (adamw default for LoRA)" in lora_run.proc.stdout
    assert "(DistilBertForSequenceClassification," in lora_run.proc.stdout
    metrics = lora_run.metrics
    trainable = metrics["trainable_parameters"]
    # 6 Linear layers x 2 blocks (width 128, FFN 256), rank 4 (A: 4 x in, B: out x 4), plus both
    # head layers in full.
    adapters = 2 * (4 * 4 * (128 + 128) + 2 * 4 * (128 + 256))
    head = 128 * 128 + 128 + 128 * 2 + 2
    assert trainable == adapters + head
    assert metrics["optimizer_state"]["by_key"]["exp_avg"]["elements"] == trainable
    assert metrics["adamw_equivalent_bytes"] == metrics["optimizer_state"]["bytes"]


def test_final_holds_adapters_and_merged_model_loads_with_the_trained_logits(lora_run):
    import torch
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from effitrain.levers.lora import apply

    final, merged_dir = lora_run.out / "final", lora_run.out / "final-merged"
    assert {"adapter_config.json", "adapter_model.safetensors", "tokenizer.json"} <= {
        p.name for p in final.iterdir()
    }
    assert not (final / "model.safetensors").exists()
    adapter_config = json.loads((final / "adapter_config.json").read_text())
    assert adapter_config["r"] == 4 and adapter_config["lora_alpha"] == 8
    assert {"pre_classifier", "classifier"} <= set(adapter_config["modules_to_save"])
    adapters = load_file(final / "adapter_model.safetensors")
    assert any("lora_B" in k and v.abs().sum() > 0 for k, v in adapters.items())  # trained

    model_dir = lora_run.data[2]
    tokenizer = AutoTokenizer.from_pretrained(merged_dir)
    batch = tokenizer(["the film was great", "awful and boring"], return_tensors="pt", padding=True)

    def logits(model):
        model.eval()
        with torch.no_grad():
            return model(**batch).logits

    # The trained model: base + LoRA with the last checkpoint's weights (saved after step 6).
    trained = apply(
        AutoModelForSequenceClassification.from_pretrained(model_dir), lora_config(lora_rank=4)
    )
    trained.load_state_dict(load_file(lora_run.out / "checkpoint-6" / "model.safetensors"))
    expected = logits(trained)
    base = logits(AutoModelForSequenceClassification.from_pretrained(model_dir))
    assert not torch.allclose(expected, base, atol=1e-4)

    reloaded = PeftModel.from_pretrained(
        AutoModelForSequenceClassification.from_pretrained(model_dir), final
    )
    torch.testing.assert_close(logits(reloaded), expected, rtol=0, atol=1e-6)
    merged = AutoModelForSequenceClassification.from_pretrained(merged_dir)
    assert not any("lora" in name for name, _ in merged.named_parameters())
    torch.testing.assert_close(logits(merged), expected, rtol=1e-5, atol=1e-5)


def test_inspect_state_names_the_adapters(lora_run, train_cli):
    proc = train_cli("inspect-state", str(lora_run.out / "checkpoint-6"), "--json", "--top", "50")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(proc.stdout)
    names = [p["parameter"] for p in report["largest"]]
    assert any(".lora_A.default.weight" in n for n in names), names
    assert any(".lora_B.default.weight" in n for n in names), names
    assert "base_model.model.classifier.modules_to_save.default.weight" in names
    assert report["optimizer_state"] == lora_run.metrics["optimizer_state"]
    assert not any("word_embeddings" in n for n in names)  # frozen: no state


def test_resume_with_lora_is_exact(lora_run, tmp_path, train_cli):
    # The fixture's run is the uninterrupted one; resume a copy of its checkpoint-3 to step 6.
    resumed = tmp_path / "resumed"
    resumed.mkdir()
    shutil.copytree(lora_run.out / "checkpoint-3", resumed / "checkpoint-3")
    args = train_args(lora_run.data, resumed, *lora_run.options, "--resume", "latest")
    proc = train_cli(*args)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "resumed from" in proc.stdout and "not an exact continuation" not in proc.stdout
    straight = lora_run.out
    compared = assert_identical(
        load_tensors(straight / "checkpoint-6"), load_tensors(resumed / "checkpoint-6")
    )
    assert compared > 40
    from safetensors.torch import load_file

    for folder in ("final", "final-merged"):
        name = "adapter_model.safetensors" if folder == "final" else "model.safetensors"
        assert_identical(load_file(straight / folder / name), load_file(resumed / folder / name))


# --------------------------------------------------------------------------------------------
# Refusals
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("options", "fragment"),
    [
        (("--lora-alpha", "16"), "--lora-alpha needs --lora-rank R"),
        (("--lora-dropout", "0.1"), "--lora-dropout needs --lora-rank R"),
        (("--lora-target-modules", "q_lin"), "--lora-target-modules needs --lora-rank R"),
        (("--lora-merge",), "--lora-merge needs --lora-rank R"),
        (("--lora-rank", "0"), "--lora-rank must be greater than 0 (got 0)"),
        (("--lora-rank", "-2"), "--lora-rank must be greater than 0 (got -2)"),
        ((*LORA, "--lora-alpha", "0"), "--lora-alpha must be greater than 0"),
        ((*LORA, "--lora-dropout", "1"), "--lora-dropout must be at least 0 and below 1"),
        ((*LORA, "--lora-dropout", "-0.1"), "--lora-dropout must be at least 0 and below 1"),
        ((*LORA, "--lora-target-modules", ","), "--lora-target-modules needs at least one"),
    ],
)
def test_bad_lora_options_are_refused_before_anything_is_built(train_cli, options, fragment):
    assert_clean_error(train_cli("train", *options), fragment)


@pytest.mark.parametrize(
    ("targets", "fragment"),
    [
        ("q_lin,nope", "--lora-target-modules nope matches no module"),
        ("classifier", "classifier is the classification head, which trains in full anyway"),
        ("attention", "attention matches distilbert.transformer.layer.0.attention"),
        ("all-linear,q_lin", "all-linear cannot be combined with other names"),
    ],
)
def test_bad_target_modules_list_the_linear_layers(train_cli, targets, fragment):
    proc = train_cli("train", "--max-steps", "1", *LORA, "--lora-target-modules", targets)
    line = assert_clean_error(proc, fragment)
    assert line.endswith(
        "this model's Linear layers: q_lin, k_lin, v_lin, out_lin, lin1, lin2 (or all-linear)"
    )


def test_missing_peft_gives_the_install_line(train_cli, monkeypatch):
    hide_package(monkeypatch, "peft")
    proc = train_cli("train", *LORA, "--dataset", "no-such-dataset-is-ever-loaded")
    assert_clean_error(proc, "--lora-rank needs peft", "pip install 'effitrain[lora]'")


def launch_state(kind: str, **extra):
    return SimpleNamespace(distributed_type=kind, num_processes=2, backend="gloo", **extra)


@pytest.mark.parametrize(
    ("state", "shown", "why"),
    [
        (
            launch_state("FSDP", fsdp_plugin=SimpleNamespace(fsdp_version=1, use_orig_params=True)),
            "FSDP1",
            "flattens the frozen base and the trained adapters",
        ),
        (
            launch_state("DEEPSPEED", deepspeed_plugin=SimpleNamespace(zero_stage=2)),
            "DeepSpeed ZeRO-2",
            "has not run peft's adapters under DeepSpeed",
        ),
    ],
)
def test_lora_under_flat_sharding_is_refused_with_a_reason(state, shown, why):
    from effitrain.distributed import Launch
    from effitrain.errors import EffitrainError
    from effitrain.levers import check_launch

    launch = Launch.of(state)
    with pytest.raises(EffitrainError) as error:
        check_launch(lora_config(lora_rank=4), launch)
    message = str(error.value)
    assert "\n" not in message and f"--lora-rank is not supported under {shown}" in message
    assert why in message and "use FSDP2 (fsdp_version: 2) or DDP" in message
    check_launch(lora_config(), launch)  # without LoRA: not this rule's business


def test_lora_runs_under_fsdp2_and_ddp():
    """FSDP2 shards the frozen base and the adapters tensor by tensor (the two-process runs in
    tests/test_fsdp2_optim.py); DDP replicates them."""
    from effitrain.distributed import Launch
    from effitrain.levers import check_launch

    fsdp2 = launch_state(
        "FSDP", fsdp_plugin=SimpleNamespace(fsdp_version=2, reshard_after_forward=True)
    )
    for state in (fsdp2, launch_state("MULTI_CPU")):
        check_launch(lora_config(lora_rank=4), Launch.of(state))


def test_lora_combines_with_the_other_levers_in_the_config():
    # Not forbidden here: step in backward updates only the adapters and head; bf16 base weights
    # keep fp32 adapters (peft's autocast_adapter_dtype).
    lora_config(lora_rank=4, optimizer_in_backward=True, weights_dtype="bf16")


# Two DDP processes: tests/test_distributed.py (test_lora_with_two_ddp_processes_...), in the
# one launch its DDP runs share.


def test_lora_lr_default_for_adamw_on_pretrained_weights():
    pretrained = "/some/pretrained-folder"
    from effitrain.build import resolve_hyperparameters  # a run's: adapters' defaults for LoRA
    from effitrain.tasks import get_task

    def hyper(**options):
        return resolve_hyperparameters(lora_config(**options), get_task("causal-lm"))

    config = hyper(model=pretrained, lora_rank=8)
    assert (config.lr, config.lr_note) == (2e-3, "adamw default for LoRA")
    # Without LoRA, or from scratch (a preset), or an optimizer not measured with LoRA: as before.
    assert hyper(model=pretrained).lr == 2e-4
    assert hyper(lora_rank=8).lr == 1e-3
    assert hyper(lora_rank=8).lr_note == "adamw default for training from scratch"
    assert hyper(model=pretrained, lora_rank=8, optim="adafactor-hf").lr == 2e-3
    assert hyper(model=pretrained, lora_rank=8, lr=5e-4).lr == 5e-4


def test_torch_adafactor_is_refused_with_lora():
    from effitrain.errors import EffitrainError

    with pytest.raises(EffitrainError) as error:
        lora_config(model="/some/pretrained-folder", lora_rank=8, optim="adafactor")
    message = str(error.value)
    assert message.startswith("--optim adafactor cannot train LoRA adapters")
    assert "use --optim adafactor-hf" in message and "\n" not in message
    lora_config(lora_rank=8, optim="adafactor-hf")  # the Trainer's Adafactor: a plain lr
