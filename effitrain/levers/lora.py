"""LoRA through peft: ``--lora-rank R`` trains low-rank adapters and the classification head only.

What gets adapters (``--lora-target-modules``, else automatic): every Linear layer outside the
head (peft's ``all-linear``), as QLoRA recommends. peft's own per-architecture default (BERT,
RoBERTa, Llama, …: the attention query and value projections only, as in the LoRA paper) learned
less on the fine-tuning benchmark (benchmarks/finetune/, docs/levers.md).
``--lora-target-modules query,value`` still chooses them; the banner names the layers chosen.

The head trains in full through peft's ``modules_to_save``: every top-level module of the
``*ForSequenceClassification`` model outside its base model, and the base model's pooler where
there is one: DistilBERT's ``pre_classifier`` + ``classifier``, BERT's ``bert.pooler`` +
``classifier``, RoBERTa's and MPNet's ``classifier`` block (dense + projection), GPT-2's
``score``. peft alone would train only ``classifier``/``score``: BERT's pooler (the dense layer
RoBERTa's head has inside it) would stay frozen, and a sentence-embedding checkpoint such as
all-MiniLM-L6-v2, trained through mean pooling, never trained it.

The final save writes the adapters (``adapter_config.json`` + ``adapter_model.safetensors``,
peft's ``save_pretrained``), and with ``--lora-merge`` also ``final-merged/``: the base model with
the adapters merged in, loadable with ``AutoModelForSequenceClassification.from_pretrained``.

peft is imported inside the functions: it is an optional extra (``effitrain[lora]``).
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from effitrain.config import MEMORY_LEVERS, OptionGroup, option, option_field
from effitrain.errors import EffitrainError, MissingPackage
from effitrain.levers.spec import Lever, Search

if TYPE_CHECKING:
    import torch
    from accelerate import Accelerator
    from peft import LoraModel, PeftModel

    from effitrain.config import TrainConfig
    from effitrain.distributed import Launch
    from effitrain.parts import RunParts
    from effitrain.report.live import Reporter

INSTALL = "pip install 'effitrain[lora]'"
UNTRIED_SHARDING = {
    "fsdp1": "it flattens the frozen base and the trained adapters into shared flat parameters, "
    "which effitrain has not run",
    "deepspeed": "effitrain has not run peft's adapters under DeepSpeed, which needs GPUs",
}
"""The shardings LoRA is refused under, and why (docs/distributed.md)."""
ALL_LINEAR = "all-linear"
MERGED_DIR = "final-merged"


def adapters_on(config: TrainConfig) -> bool:
    """Whether the run trains LoRA adapters (``--lora-rank``): the one test of it (outside the
    levers, ``effitrain.levers.trains_adapters``)."""
    return LoRAOptions.of(config).lora_rank is not None


def alpha(config: TrainConfig) -> float:
    """LoRA's alpha: the given one, else 2 x rank."""
    options = LoRAOptions.of(config)
    return options.lora_alpha if options.lora_alpha is not None else 2.0 * (options.lora_rank or 0)


def dropout(config: TrainConfig) -> float:
    """Dropout on the adapters' inputs: the given one, else 0.05."""
    given = LoRAOptions.of(config).lora_dropout
    return given if given is not None else 0.05


@dataclass
class LoRAOptions(OptionGroup):
    """``--lora-rank, --lora-alpha, --lora-dropout, --lora-target-modules, --lora-merge``."""

    lora_rank: int | None = option_field(
        None,
        "Train LoRA adapters of this rank (peft) instead of the whole model.",
        panel=MEMORY_LEVERS,
        elsewhere=("lora_r",),
    )
    lora_alpha: float | None = option_field(
        None, "LoRA scaling alpha (default: 2 x rank).", panel=MEMORY_LEVERS, metavar="ALPHA"
    )
    lora_dropout: float | None = option_field(
        None,
        "Dropout on the LoRA adapters' inputs (default: 0.05).",
        panel=MEMORY_LEVERS,
        metavar="P",
    )
    lora_target_modules: list[str] | None = option_field(
        None,
        "Modules that get adapters, by name, or all-linear (the default: every Linear layer "
        "outside the classification head). Comma-separated: query,value.",
        panel=MEMORY_LEVERS,
        metavar="NAME[,NAME]",
    )
    lora_merge: bool = option_field(
        False,
        "The final save also writes the base model with the adapters merged in.",
        panel=MEMORY_LEVERS,
    )


class LoRA(Lever):
    name = "lora"
    options = LoRAOptions
    save_only = ("lora_merge",)
    removes = "the gradients and optimizer state of the frozen base model"
    packages = ("peft",)
    install = INSTALL
    trains_adapters = True
    search = Search((None, 16))
    time_cost = "less than full fine-tuning: no weight gradients for the frozen base"

    def is_on(self, config: TrainConfig) -> bool:
        return adapters_on(config)

    def check(self, config: TrainConfig) -> None:
        given = [
            option(name) for name in self.fields[1:] if getattr(config, name) not in (None, False)
        ]
        options = LoRAOptions.of(config)
        if options.lora_rank is None:
            if given:
                raise EffitrainError(
                    f"{given[0]} needs --lora-rank R (LoRA is off without it); add --lora-rank "
                    f"8, or drop {given[0]}"
                )
            return
        if options.lora_rank <= 0:
            raise EffitrainError(f"--lora-rank must be greater than 0 (got {options.lora_rank})")
        if options.lora_alpha is not None and not options.lora_alpha > 0:
            raise EffitrainError(f"--lora-alpha must be greater than 0 (got {options.lora_alpha})")
        if options.lora_dropout is not None and not 0 <= options.lora_dropout < 1:
            raise EffitrainError(
                f"--lora-dropout must be at least 0 and below 1 (got {options.lora_dropout})"
            )
        if options.lora_target_modules is not None and not options.lora_target_modules:
            raise EffitrainError(
                "--lora-target-modules needs at least one module name (or all-linear)"
            )
        if config.optim == "adafactor":
            # Its update is relative to each weight's RMS; LoRA's B matrices start at zero.
            raise EffitrainError(
                "--optim adafactor cannot train LoRA adapters: its step is relative to each "
                "weight's size (RMS), and LoRA's B matrices start at zero, so they barely move; "
                "use --optim adafactor-hf (the Trainer's Adafactor: the same factored state, a "
                "plain lr) or adamw"
            )

    def check_launch(self, config: TrainConfig, launch: Launch) -> None:
        require_peft()
        why = UNTRIED_SHARDING.get(launch.sharding.kind)
        if why:
            # FSDP2 shards the frozen base and the adapters tensor by tensor, and its checkpoints
            # and final save gather them (tested on two processes); these have not been run.
            raise EffitrainError(
                f"--lora-rank is not supported under {launch.sharding.description}: {why}; use "
                "FSDP2 (fsdp_version: 2) or DDP (accelerate launch --multi_gpu)"
            )

    def apply_to_model(
        self, model: torch.nn.Module, config: TrainConfig, device: torch.device | None
    ) -> torch.nn.Module:
        # peft wraps the model as it is then (dtype included: adapters over bf16 base weights
        # are created in fp32, peft's autocast_adapter_dtype).
        return apply(model, config)

    def banner(self, config: TrainConfig, model: torch.nn.Module) -> str:
        return describe(model, config)

    def after_final_save(self, run: RunParts, reporter: Reporter) -> None:
        """``final-merged/`` with --lora-merge: after the summary, because merging changes the
        model in place (its parameters no longer are the ones that trained)."""
        config = run.config
        if not config.output_dir:
            return
        if LoRAOptions.of(config).lora_merge:
            merged = save_merged(run.accelerator, run.model, run.tokenizer, config.output_dir)
            reporter.saved_final(str(merged))
        from effitrain.models import base_model

        base = base_model(run.accelerator.unwrap_model(run.model))
        note = final_note(config, quantized=getattr(base, "is_loaded_in_4bit", False))
        if note:
            reporter.note(note)


def require_peft() -> None:
    """Raises: EffitrainError with the install line when peft is missing."""
    if importlib.util.find_spec("peft") is None:
        raise MissingPackage(f"--lora-rank needs peft, which is not installed: {INSTALL}")


def _linear_types() -> tuple[type, ...]:
    import torch
    from transformers.pytorch_utils import Conv1D

    return (torch.nn.Linear, Conv1D)


def _supported_types() -> tuple[type, ...]:
    import torch

    conv = (torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d)
    return (*_linear_types(), torch.nn.Embedding, *conv)


def _in_head(name: str, head: list[str]) -> bool:
    return any(name == h or name.startswith(h + ".") for h in head)


def _leaf_names(names: list[str]) -> list[str]:
    """Last name components, in model order, each once (``q_lin``, ``v_lin``)."""
    return list(dict.fromkeys(name.rsplit(".", 1)[-1] for name in names))


def linear_candidates(model: torch.nn.Module, head: list[str]) -> list[str]:
    """Names that ``--lora-target-modules`` can take: the Linear layers outside the head."""
    linear = _linear_types()
    return _leaf_names(
        [
            name
            for name, module in model.named_modules()
            if isinstance(module, linear) and not _in_head(name, head)
        ]
    )


def resolve_targets(
    model: torch.nn.Module, given: list[str] | None, head: list[str]
) -> str | list[str]:
    """``target_modules`` for peft (``_why`` says why, for the banner).

    Raises:
        EffitrainError: a given name matches no module, only a head module, or a module type
            LoRA cannot adapt; the message lists the Linear layers to choose from.
    """
    if given is None or given == [ALL_LINEAR]:
        return ALL_LINEAR
    modules = dict(model.named_modules())
    supported = _supported_types()

    def refuse(reason: str) -> EffitrainError:
        choices = ", ".join(linear_candidates(model, head))
        return EffitrainError(
            f"--lora-target-modules {reason}; this model's Linear layers: {choices} "
            f"(or {ALL_LINEAR})"
        )

    for target in given:
        if target == ALL_LINEAR:
            raise refuse(f"{ALL_LINEAR} cannot be combined with other names")
        matches = [n for n in modules if n == target or n.endswith("." + target)]
        if not matches:
            raise refuse(f"{target} matches no module")
        outside = [n for n in matches if not _in_head(n, head)]
        if not outside:
            raise refuse(f"{target} is the classification head, which trains in full anyway")
        wrong = [n for n in outside if not isinstance(modules[n], supported)]
        if wrong:
            raise refuse(
                f"{target} matches {wrong[0]} ({type(modules[wrong[0]]).__name__}), "
                "which LoRA cannot adapt"
            )
    return list(given)


def _why(given: list[str] | None) -> str:
    """Why these layers have adapters (for the banner)."""
    if given is None:
        return "all linear layers, the default"
    return "all linear layers" if given == [ALL_LINEAR] else "--lora-target-modules"


def apply(model: torch.nn.Module, config: TrainConfig) -> torch.nn.Module:
    """Wrap ``model`` in a peft LoRA model: adapters on the target modules, the head in full.

    Raises:
        EffitrainError: peft is missing, or the target modules are wrong (see
            :func:`resolve_targets`).
    """
    require_peft()
    import logging
    import warnings

    # peft imports bitsandbytes when it is installed, which logs about an optional 4-bit CPU
    # kernel that LoRA does not use (as in effitrain.optim).
    logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)
    from peft import LoraConfig, TaskType, get_peft_model

    from effitrain.models import head_modules, is_causal_lm

    head = head_modules(model)
    options = LoRAOptions.of(config)
    targets = resolve_targets(model, options.lora_target_modules, head)
    assert options.lora_rank is not None  # applied only where adapters_on

    lora_config = LoraConfig(
        task_type=TaskType.CAUSAL_LM if is_causal_lm(model) else TaskType.SEQ_CLS,
        r=options.lora_rank,
        lora_alpha=alpha(config),  # type: ignore[arg-type]  # peft says int; it divides by r
        lora_dropout=dropout(config),
        target_modules=targets,
        modules_to_save=head or None,
    )
    try:
        with warnings.catch_warnings():
            # transformers 5 deprecates the attribute that peft reads; nothing for the user.
            warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*")
            return get_peft_model(model, lora_config)
    except ValueError as exc:  # what resolve_targets did not foresee, still one line
        from effitrain.errors import first_line

        raise EffitrainError(
            f"--lora-rank: peft cannot adapt this model: {first_line(exc)}"
        ) from exc


def original_parameters(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The parameters of the model as it was before peft: without the adapters (``lora_``)
    and without the trained copies of the head (``modules_to_save``; the originals stay)."""
    return [
        p
        for name, p in model.named_parameters()
        if "lora_" not in name and ".modules_to_save." not in name
    ]


def describe(model: torch.nn.Module, config: TrainConfig) -> str:
    """One banner line: rank, alpha, dropout, the adapted layers, the head, what trains."""
    from effitrain.memory.ledger import parameter_count, trainable_parameter_count
    from effitrain.models import head_modules

    peft_model = cast("PeftModel", model)  # apply_to_model wrapped it
    base = peft_model.get_base_model()
    head = head_modules(base)
    options = LoRAOptions.of(config)
    why = _why(options.lora_target_modules)  # checked by apply, on the model before peft
    tuner = cast("LoraModel", peft_model.base_model)  # peft types it as the model it wrapped
    targeted = _leaf_names(list(tuner.targeted_module_names))
    total = parameter_count(peft_model)  # 4-bit: unpacked
    default = "" if options.lora_alpha is not None else " (2 x rank)"
    return (
        f"LoRA r={options.lora_rank} alpha={alpha(config):g}{default} dropout "
        f"{dropout(config):g} on {', '.join(targeted)} ({why}); "
        + (f"head {', '.join(head)} trains in full; " if head else "")
        + f"{trainable_parameter_count(peft_model):,} of "
        f"{total:,} parameters train"
    )


def final_note(config: TrainConfig, quantized: bool) -> str | None:
    """What to say when ``final/`` holds adapters whose base weights are saved nowhere."""
    from effitrain.models import is_preset

    if is_preset(config.model) and quantized:
        return (
            f"final/ holds the LoRA adapters only; they apply to the '{config.model}' preset's "
            "random base weights, which are saved nowhere else (--load-in-4bit cannot merge)"
        )
    if is_preset(config.model) and not LoRAOptions.of(config).lora_merge:
        return (
            f"final/ holds the LoRA adapters only; the '{config.model}' preset's random base "
            "weights are saved nowhere else: add --lora-merge for a complete model"
        )
    return None


def save_merged(
    accelerator: Accelerator, model: torch.nn.Module, tokenizer: Any, output_dir: str | Path
) -> Path:
    """Merge the adapters into the base weights and save a plain model to ``final-merged/``
    (:func:`effitrain.checkpoint.save_final`: temporary folder, then renamed into place).

    Merges in place (no second copy of the model in memory): call it last, once nothing else
    needs the LoRA model. Every process calls it; the main process writes.

    Raises:
        EffitrainError: the folder cannot be written.
    """
    from effitrain.checkpoint import final_step, save_final

    merged = accelerator.unwrap_model(model).merge_and_unload()
    return save_final(
        accelerator,
        merged,
        tokenizer,
        output_dir,
        global_step=final_step(output_dir) or 0,
        folder=MERGED_DIR,
    )
