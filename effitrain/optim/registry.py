"""The optimizer registry: name -> how to build it, its default lr, and what state it keeps.

Optional libraries (bitsandbytes) are imported inside their factory, so a missing extra is one
clear message when the optimizer is chosen, not an import error at start-up. This module imports
nothing heavy at module level: ``effitrain optimizers`` and ``--help`` stay instant.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from effitrain.errors import EffitrainError
from effitrain.models import is_preset

if TYPE_CHECKING:
    import torch

    from effitrain.config import TrainConfig

ParamGroups = list[dict[str, Any]]

SCRATCH, FINE_TUNE = "training from scratch", "fine-tuning"
"""The two regimes with their own defaults: a built-in preset (random init) or pretrained weights
(a hub id or a folder saved with save_pretrained)."""


@dataclass(frozen=True)
class Defaults:
    """What a run uses when the options leave lr, warmup or schedule open."""

    lr: float
    warmup_ratio: float
    scheduler: str


@dataclass(frozen=True)
class OptimizerSpec:
    """One registry entry."""

    name: str
    class_path: str
    """Dotted path of the optimizer class, e.g. torch.optim.AdamW."""
    module: str
    """Module that must be importable for this optimizer."""
    install: str
    """What to install when ``module`` is missing."""
    scratch: Defaults
    """Defaults for the built-in presets, trained from random init."""
    fine_tune: Defaults
    """Defaults for pretrained weights, chosen on real checkpoints (benchmarks/finetune/)."""
    description: str
    state: str
    """The state it keeps per parameter tensor."""
    factory: Callable[[ParamGroups, float], torch.optim.Optimizer]
    caveat: str = ""
    """Where its defaults are known not to learn (shown by ``effitrain optimizers``)."""
    state_bytes_note: str = ""
    """What explains its measured bytes per parameter (``state_bytes_per_param``), shown beside
    the figure, e.g. 'tensors < 4096 elements keep fp32 state: 8'. Never the figure itself."""
    lora: Defaults | None = None
    """Defaults for LoRA adapters on pretrained weights (``--lora-rank``), where the fine-tuning
    benchmark chose them (benchmarks/finetune/); None: the fine-tuning defaults."""
    model_factory: Callable[[torch.nn.Module, ParamGroups, float], torch.optim.Optimizer] | None = (
        None
    )
    """For optimizers that must see the model, not only its parameter groups (Muon's split of
    hidden matrices from embeddings and head, GaLore's and APOLLO's projected matrices,
    Adam-mini's blocks): ``model_factory(model, groups, lr)`` is used instead of ``factory``.
    Such an optimizer is not per-parameter, so ``--optimizer-in-backward`` refuses it."""

    @property
    def per_parameter(self) -> bool:
        """Whether it can be built over one parameter at a time (``--optimizer-in-backward``)."""
        return self.model_factory is None

    @property
    def takes_fp32_embedding_state(self) -> bool:
        """bitsandbytes' 8-bit optimizers: ``--fp32-embedding-state`` can keep the embeddings'
        state in 32 bits (see ``keep_embeddings_32bit``)."""
        return self.module == "bitsandbytes"

    def is_available(self) -> bool:
        return importlib.util.find_spec(self.module) is not None

    def defaults(self, regime: str) -> Defaults:
        """The defaults for ``SCRATCH`` or ``FINE_TUNE``."""
        return self.scratch if regime == SCRATCH else self.fine_tune


def _adamw(groups: ParamGroups, lr: float) -> torch.optim.Optimizer:
    import torch

    return torch.optim.AdamW(groups, lr=lr)


def _adafactor(groups: ParamGroups, lr: float) -> torch.optim.Optimizer:
    import torch

    # lr caps a *relative* step: step size = max(eps2, RMS(param)) * min(lr, 1/sqrt(t)).
    return torch.optim.Adafactor(groups, lr=lr)


def _adafactor_hf(groups: ParamGroups, lr: float) -> torch.optim.Optimizer:
    from transformers.optimization import Adafactor

    # The Trainer's optim="adafactor": a plain lr, no relative step, no parameter scaling.
    return Adafactor(groups, lr=lr, relative_step=False, scale_parameter=False, warmup_init=False)


def _adamw_8bit(groups: ParamGroups, lr: float) -> torch.optim.Optimizer:
    # bitsandbytes logs a warning about an optional 4-bit CPU kernel on import; it does not
    # concern 8-bit optimizers, so keep it out of the user's console.
    logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)
    import bitsandbytes as bnb

    return bnb.optim.AdamW8bit(groups, lr=lr)


def _adam_mini(model: torch.nn.Module, groups: ParamGroups, lr: float) -> torch.optim.Optimizer:
    from effitrain.optim.adam_mini import build

    return build(model, groups, lr)


def _torchao(class_name: str) -> Callable[[ParamGroups, float], torch.optim.Optimizer]:
    def factory(groups: ParamGroups, lr: float) -> torch.optim.Optimizer:
        from effitrain.optim.low_bit import build

        return build(class_name, groups, lr)

    return factory


def _sgd(groups: ParamGroups, lr: float) -> torch.optim.Optimizer:
    import torch

    return torch.optim.SGD(groups, lr=lr, momentum=0.9)


def _muon(model: torch.nn.Module, groups: ParamGroups, lr: float) -> torch.optim.Optimizer:
    from effitrain.optim.split import build_muon

    return build_muon(model, groups, lr)


def _galore(model: torch.nn.Module, groups: ParamGroups, lr: float) -> torch.optim.Optimizer:
    from effitrain.optim.split import build_galore

    return build_galore(model, groups, lr)


def _apollo(model: torch.nn.Module, groups: ParamGroups, lr: float) -> torch.optim.Optimizer:
    from effitrain.optim.split import build_apollo

    return build_apollo(model, groups, lr)


def _apollo_mini(model: torch.nn.Module, groups: ParamGroups, lr: float) -> torch.optim.Optimizer:
    from effitrain.optim.split import build_apollo

    return build_apollo(model, groups, lr, mini=True)


def _by_model_only(groups: ParamGroups, lr: float) -> torch.optim.Optimizer:
    raise EffitrainError("this optimizer is built over the model (OptimizerSpec.model_factory)")


def _lion(groups: ParamGroups, lr: float) -> torch.optim.Optimizer:
    from lion_pytorch import Lion

    # Plain torch (its optional Triton kernel off): runs on FSDP2's DTensors, unlike bnb's Lion.
    return Lion(groups, lr=lr)


def _lion_8bit(groups: ParamGroups, lr: float) -> torch.optim.Optimizer:
    logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)
    import bitsandbytes as bnb

    return bnb.optim.Lion8bit(groups, lr=lr)


CAME_BETAS = (0.9, 0.999, 0.99)
"""CAME's betas here: its third (the confidence average's) at 0.99, not its paper's 0.9999.

None of CAME's moments is bias-corrected and its update divides by the root of the confidence
average, which starts at ``1 - beta3**t`` of its settled value: at 0.9999 early updates are many
times larger than the lr says for thousands of steps (see docs/optimizers.md).
"""


def _came(groups: ParamGroups, lr: float) -> torch.optim.Optimizer:
    from pytorch_optimizer import CAME

    return CAME(groups, lr=lr, betas=CAME_BETAS)


def _adamw_schedule_free(groups: ParamGroups, lr: float) -> torch.optim.Optimizer:
    from schedulefree import AdamWScheduleFree

    # No internal warmup_steps: effitrain's "constant" schedule warms up through the lr, which
    # schedule-free follows the same way (lr_max and the average's weights), and it is logged.
    return AdamWScheduleFree(groups, lr=lr)


IN_BACKWARD_REFUSED = {
    "adamw-schedule-free": "its step count and averaging weights live in the parameter group, "
    "which each per-parameter optimizer would keep apart from the checkpoint (resume would "
    "restart the average)",
    **dict.fromkeys(
        ("adamw-8bit-ao", "adamw-4bit", "adamw-fp8"),
        "torchao's optimizers keep lr as a tensor (the per-parameter wrapper sets a float) and "
        "torch.compile their step (use adamw-8bit or adamw with the lever)",
    ),
}
"""Per-parameter optimizers that still cannot run in backward, and why."""


def set_train_mode(optimizer: Any, train: bool) -> None:
    """``optimizer.train()`` or ``.eval()`` where it has them (schedule-free: eval mode holds the
    averaged weights, the ones to evaluate and save); otherwise nothing.

    Unwraps Accelerate's ``AcceleratedOptimizer`` (``.optimizer``) and reaches the per-parameter
    optimizers of ``--optimizer-in-backward`` (``.optimizers``).
    """
    inner = getattr(optimizer, "optimizer", None)
    if inner is not None and inner is not optimizer:
        set_train_mode(inner, train)
        return
    optimizers = getattr(optimizer, "optimizers", None)
    if isinstance(optimizers, dict):
        for each in optimizers.values():
            set_train_mode(each, train)
        return
    method = getattr(optimizer, "train" if train else "eval", None)
    if callable(method):
        method()


OPTIMIZERS: dict[str, OptimizerSpec] = {
    spec.name: spec
    for spec in (
        OptimizerSpec(
            name="adamw",
            class_path="torch.optim.AdamW",
            module="torch",
            install="pip install torch",
            scratch=Defaults(1e-3, 0.06, "linear"),
            fine_tune=Defaults(2e-4, 0.1, "linear"),
            description="Adam with decoupled weight decay; the reference everything is compared to",
            state="step, exp_avg, exp_avg_sq",
            factory=_adamw,
            lora=Defaults(2e-3, 0.1, "linear"),
        ),
        OptimizerSpec(
            name="adafactor",
            class_path="torch.optim.Adafactor",
            module="torch",
            install="pip install 'torch>=2.5'",
            scratch=Defaults(3e-2, 0.06, "linear"),
            fine_tune=Defaults(3e-3, 0.1, "linear"),
            description="factored second moment (row + column sums); lr caps a relative step",
            state="step, row_var + col_var (>=2-D), variance (1-D)",
            state_bytes_note="about 4(m+n)/(mn) for an m x n weight",
            factory=_adafactor,
        ),
        OptimizerSpec(
            name="adafactor-hf",
            class_path="transformers.optimization.Adafactor",
            module="transformers",
            install="pip install transformers",
            scratch=Defaults(1e-3, 0.06, "linear"),
            fine_tune=Defaults(1e-4, 0.1, "linear"),
            description="transformers' Adafactor as the Trainer uses it (no relative step)",
            state="step, exp_avg_sq_row/col (>=2-D) or exp_avg_sq, RMS",
            state_bytes_note="fp32 state, factored as adafactor",
            factory=_adafactor_hf,
            lora=Defaults(2e-3, 0.1, "linear"),  # as adamw's (benchmarks/levers/)
        ),
        OptimizerSpec(
            name="adamw-8bit",
            class_path="bitsandbytes.optim.AdamW8bit",
            module="bitsandbytes",
            install="pip install 'effitrain[8bit]'  (bitsandbytes)",
            scratch=Defaults(7e-4, 0.06, "linear"),
            fine_tune=Defaults(2e-4, 0.1, "linear"),
            description="AdamW with block-wise 8-bit quantized moments",
            state="state1, state2 (uint8), absmax1/2, qmap1/2 (shared)",
            state_bytes_note="tensors < 4096 elements keep fp32 state: 8",
            factory=_adamw_8bit,
            lora=Defaults(2e-3, 0.1, "linear"),  # AdamW's update, 8-bit moments: as adamw
        ),
        OptimizerSpec(
            name="sgd",
            class_path="torch.optim.SGD",
            module="torch",
            install="pip install torch",
            scratch=Defaults(5e-2, 0.06, "linear"),
            fine_tune=Defaults(5e-2, 0.1, "linear"),
            description="SGD with momentum 0.9",
            state="momentum_buffer",
            factory=_sgd,
            caveat="its defaults fail the demo from scratch and long texts",  # docs/optimizers.md
        ),
        OptimizerSpec(
            name="adam-mini",
            class_path="adam_mini.Adam_mini",
            module="adam_mini",
            install="pip install 'effitrain[mini]'  (adam-mini)",
            scratch=Defaults(1e-3, 0.06, "linear"),
            fine_tune=Defaults(5e-5, 0.1, "linear"),
            description="Adam with one second moment per block (attention head, neuron row)",
            state="step, m, vmean (per head or row), head/neuron_per_gpu; 1-D: m, v",
            # A quarter of AdamW's lr: a pretrained model's outlier features make its per-row and
            # per-head steps far larger than Adam's on the weights that read them
            # (docs/optimizers.md; benchmarks/finetune/).
            caveat="fine-tuning above lr 5e-5 failed long texts (docs/optimizers.md)",
            factory=_adamw,  # unused: model_factory builds it (it partitions by name)
            model_factory=_adam_mini,
        ),
        OptimizerSpec(
            name="muon",
            class_path="torch.optim.Muon + torch.optim.AdamW",
            module="torch",
            install="pip install 'torch>=2.9'",
            scratch=Defaults(1e-3, 0.06, "linear"),
            # Above AdamW's 2e-4, at which it fell behind AdamW (benchmarks/finetune/).
            fine_tune=Defaults(5e-4, 0.1, "linear"),
            description="Muon on hidden matrices (lr matched to AdamW's RMS), AdamW on the rest",
            state="momentum_buffer (Muon); step, exp_avg, exp_avg_sq (AdamW)",
            state_bytes_note="hidden 4, rest 8",
            factory=_by_model_only,
            model_factory=_muon,
        ),
        OptimizerSpec(
            name="galore",
            class_path="pytorch_optimizer.GaLore",
            module="pytorch_optimizer",
            install="pip install 'effitrain[galore]'  (pytorch-optimizer)",
            scratch=Defaults(1e-3, 0.06, "linear"),
            # Above AdamW's 2e-4, at which it fell behind AdamW (benchmarks/finetune/).
            fine_tune=Defaults(1e-3, 0.1, "linear"),
            description="hidden matrices: Adam on SVD-projected gradients (rank <= 128); rest AdamW",
            state="exp_avg, exp_avg_sq (projected), projector.ortho_matrix (rank x n)",
            state_bytes_note="rank 128",
            factory=_by_model_only,
            caveat="from scratch it learns slowly (docs/optimizers.md)",
            model_factory=_galore,
        ),
        OptimizerSpec(
            name="apollo",
            class_path="apollo_torch.APOLLOAdamW",
            module="apollo_torch",
            install="pip install 'effitrain[apollo]'  (apollo-torch)",
            scratch=Defaults(1e-3, 0.06, "linear"),
            fine_tune=Defaults(2e-4, 0.1, "linear"),
            description="hidden matrices: gradient scaled by random-projected Adam; rest AdamW",
            state="exp_avg, exp_avg_sq (projected), projector, seed, scaled_grad",
            state_bytes_note="rank 128",
            factory=_by_model_only,
            model_factory=_apollo,
        ),
        OptimizerSpec(
            name="apollo-mini",
            class_path="apollo_torch.APOLLOAdamW",
            module="apollo_torch",
            install="pip install 'effitrain[apollo]'  (apollo-torch)",
            scratch=Defaults(1e-3, 0.06, "linear"),
            fine_tune=Defaults(2e-4, 0.1, "linear"),
            description="APOLLO-Mini: rank 1, one scale per matrix; rest AdamW",
            state="as apollo, rank 1",
            factory=_by_model_only,
            model_factory=_apollo_mini,
        ),
        OptimizerSpec(
            name="lion",
            class_path="lion_pytorch.Lion",
            module="lion_pytorch",
            install="pip install 'effitrain[lion]'  (lion-pytorch)",
            scratch=Defaults(3e-4, 0.06, "linear"),
            fine_tune=Defaults(1e-4, 0.1, "linear"),
            description="sign of an interpolated momentum (Lion); lr ~3-10x below AdamW's",
            state="exp_avg",
            factory=_lion,
        ),
        OptimizerSpec(
            name="lion-8bit",
            class_path="bitsandbytes.optim.Lion8bit",
            module="bitsandbytes",
            install="pip install 'effitrain[8bit]'  (bitsandbytes)",
            scratch=Defaults(3e-4, 0.06, "linear"),
            fine_tune=Defaults(1e-4, 0.1, "linear"),
            description="Lion with a block-wise 8-bit quantized momentum (bitsandbytes)",
            state="state1 (uint8), absmax1, qmap1 (shared)",
            state_bytes_note="tensors < 4096 elements keep fp32 state: 4",
            factory=_lion_8bit,
        ),
        OptimizerSpec(
            name="came",
            class_path="pytorch_optimizer.CAME",
            module="pytorch_optimizer",
            install="pip install 'effitrain[came]'  (pytorch-optimizer)",
            # Both lrs go with CAME_BETAS (lr sweeps: docs/optimizers.md).
            scratch=Defaults(1e-3, 0.06, "linear"),
            fine_tune=Defaults(1e-4, 0.1, "linear"),
            description="Adafactor-like factored second moment plus a factored confidence term",
            state="exp_avg; exp_avg_sq_row/col, exp_avg_res_row/col (1-D: exp_avg_sq); RMS",
            factory=_came,
        ),
        OptimizerSpec(
            name="adamw-schedule-free",
            class_path="schedulefree.AdamWScheduleFree",
            module="schedulefree",
            install="pip install 'effitrain[schedulefree]'  (schedulefree)",
            scratch=Defaults(2e-3, 0.06, "constant"),
            # AdamW's lr: a higher one failed the long reviews (benchmarks/finetune/).
            fine_tune=Defaults(2e-4, 0.1, "constant"),
            description="AdamW with iterate averaging instead of a schedule (eval mode: the average)",
            state="z, exp_avg_sq",
            caveat="from scratch it learns slowly (docs/optimizers.md)",
            factory=_adamw_schedule_free,
        ),
        OptimizerSpec(
            name="adamw-8bit-ao",
            class_path="torchao.optim.AdamW8bit",
            module="torchao",
            install="pip install 'effitrain[ao]'  (torchao)",
            scratch=Defaults(1e-3, 0.06, "linear"),
            fine_tune=Defaults(2e-4, 0.1, "linear"),
            description="torchao's AdamW with block-wise 8-bit moments (compiled step)",
            state="step, exp_avg, exp_avg_sq (OptimState8bit: codes, scale, qmap)",
            state_bytes_note="tensors < 4096 elements keep fp32 state: 8",
            factory=_torchao("AdamW8bit"),
        ),
        OptimizerSpec(
            name="adamw-4bit",
            class_path="torchao.optim.AdamW4bit",
            module="torchao",
            install="pip install 'effitrain[ao]'  (torchao)",
            scratch=Defaults(1e-3, 0.06, "linear"),
            fine_tune=Defaults(2e-4, 0.1, "linear"),
            description="torchao's AdamW with block-wise 4-bit moments (compiled step)",
            state="step, exp_avg, exp_avg_sq (OptimState4bit: packed codes, scale, qmap)",
            state_bytes_note="tensors < 4096 elements keep fp32 state: 8",
            factory=_torchao("AdamW4bit"),
        ),
        OptimizerSpec(
            name="adamw-fp8",
            class_path="torchao.optim.AdamWFp8",
            module="torchao",
            install="pip install 'effitrain[ao]'  (torchao)",
            scratch=Defaults(1e-3, 0.06, "linear"),
            fine_tune=Defaults(2e-4, 0.1, "linear"),
            description="torchao's AdamW with block-wise FP8 (e4m3) moments; CPU or GPU >= sm89",
            state="step, exp_avg, exp_avg_sq (OptimStateFp8: codes, scale)",
            state_bytes_note="tensors < 4096 elements keep fp32 state: 8",
            factory=_torchao("AdamWFp8"),
        ),
    )
}


STATE_BYTES_FILE = "state_bytes.json"
"""Package data beside this module: each optimizer's measured state bytes per trained parameter,
and what they were measured on. Written by ``python -m benchmarks.optimizer_costs.run --render``
from that benchmark's results.json; never edited by hand."""


@functools.cache
def measured_state_bytes() -> dict[str, Any]:
    """The contents of :data:`STATE_BYTES_FILE`: ``settings`` (what was measured: model, weights
    dtype, when in the run), ``runs`` (which benchmark runs gave the figures) and
    ``bytes_per_param`` (optimizer name -> figure). Read once; no torch import."""
    from importlib import resources

    return json.loads(resources.files("effitrain.optim").joinpath(STATE_BYTES_FILE).read_text())


def state_bytes_per_param(name: str) -> float | None:
    """The measured optimizer-state bytes per trained parameter of optimizer ``name`` (see
    :func:`measured_state_bytes` for the settings); None where it has not been measured."""
    return measured_state_bytes()["bytes_per_param"].get(name)


def get_spec(name: str) -> OptimizerSpec:
    """Look up an optimizer by name; an unknown name lists the valid ones."""
    try:
        return OPTIMIZERS[name]
    except KeyError:
        raise EffitrainError(
            f"unknown optimizer '{name}'; choose one of: {', '.join(OPTIMIZERS)} "
            "(see `effitrain optimizers`)"
        ) from None


def check_options(config: TrainConfig) -> None:
    """The optimizer options: a registered name, and ``--fp32-embedding-state`` only where there
    is 8-bit state to override.

    Raises:
        EffitrainError: naming the option (an unknown name lists the valid ones).
    """
    spec = get_spec(config.optim)
    if config.fp32_embedding_state and not spec.takes_fp32_embedding_state:
        raise EffitrainError(
            f"--fp32-embedding-state is for bitsandbytes' 8-bit optimizers (adamw-8bit, "
            f"lion-8bit); --optim {config.optim} has no 8-bit state to override: drop it"
        )


@dataclass(frozen=True)
class Hyperparameters:
    """The lr and schedule a run uses: the ones given, else the optimizer's defaults."""

    lr: float
    warmup_ratio: float
    scheduler: str
    lr_note: str
    """Why this lr when it was not given, e.g. 'adafactor default for fine-tuning'."""
    schedule_note: str
    """Why this schedule, when neither it nor the warmup was given."""


PREFERENCE_LR_DIVISOR = 40
"""Preference tuning of pretrained weights takes the fine-tuning (or LoRA) lr over this: AdamW
5e-6 (TRL's DPO default is 1e-6). At AdamW's 2e-4 SmolLM2-135M's log-prob margin ran to +186
nats with an eval loss of 0.0000 in 36 steps; at 5e-6 it learned the same pairs (every
validation pair preferred) at +34 (benchmarks/preference)."""


def resolve_hyperparameters(config: TrainConfig, adapters: bool = False) -> Hyperparameters:
    """``--lr``, ``--scheduler`` and ``--warmup-ratio``, each from the options or, when not
    given, from the optimizer's defaults for this run: a preset trains from scratch, pretrained
    weights fine-tune, and LoRA ``adapters`` on pretrained weights have their own where
    measured; preference tuning of pretrained weights divides the lr by
    :data:`PREFERENCE_LR_DIVISOR`."""
    spec = get_spec(config.optim)
    regime = SCRATCH if is_preset(config.model) else FINE_TUNE
    defaults = spec.defaults(regime)
    why = f"{spec.name} default for {regime}"
    if adapters and regime == FINE_TUNE and spec.lora is not None:
        defaults, why = spec.lora, f"{spec.name} default for LoRA"
    if config.task == "preference" and regime == FINE_TUNE:
        divisor = PREFERENCE_LR_DIVISOR
        defaults = dataclasses.replace(defaults, lr=defaults.lr / divisor)
        why = f"{why} / {divisor} for preference tuning"
    schedule_given = (config.scheduler, config.warmup_ratio, config.warmup_steps) != (None,) * 3
    return Hyperparameters(
        lr=config.lr if config.lr is not None else defaults.lr,
        warmup_ratio=(
            config.warmup_ratio if config.warmup_ratio is not None else defaults.warmup_ratio
        ),
        scheduler=config.scheduler if config.scheduler is not None else defaults.scheduler,
        lr_note="" if config.lr is not None else why,
        schedule_note="" if schedule_given else why,
    )


def param_groups(model: torch.nn.Module, weight_decay: float) -> ParamGroups:
    """Two groups: >=2-D weights decay, biases and norm weights (1-D) do not (as in nanoGPT)."""
    decay, no_decay = [], []
    for param in model.parameters():
        if not param.requires_grad:
            continue
        (decay if param.ndim >= 2 else no_decay).append(param)
    groups = [{"params": decay, "weight_decay": weight_decay}]
    if no_decay:
        groups.append({"params": no_decay, "weight_decay": 0.0})
    return groups


def build_optimizer(
    model: torch.nn.Module,
    spec: OptimizerSpec | str,
    lr: float,
    weight_decay: float,
    *,
    fp32_embedding_state: bool = False,
    builder: Callable[[ParamGroups, OptimizerSpec, float], torch.optim.Optimizer] | None = None,
) -> torch.optim.Optimizer:
    """Build the optimizer ``spec`` (a registry entry or its name) over ``model``'s trainable
    parameters.

    ``weight_decay`` applies to >=2-D weights only (see ``param_groups``).
    ``fp32_embedding_state``: bitsandbytes' 8-bit optimizers keep 32-bit state for embedding
    weights (see ``keep_embeddings_32bit``). ``builder``: how a lever builds the optimizer
    around the spec's factory, ``builder(groups, spec, lr)`` (one per parameter in backward
    hooks, or offloaded: ``effitrain.levers``); such a lever needs a per-parameter spec.

    Raises:
        EffitrainError: unknown optimizer, or its library is not installed.
    """
    spec = get_spec(spec) if isinstance(spec, str) else spec
    if not spec.is_available():
        raise EffitrainError(
            f"optimizer '{spec.name}' needs the '{spec.module}' package, which is not installed: "
            f"{spec.install}"
        )
    groups = param_groups(model, weight_decay)
    kept = 0
    if spec.takes_fp32_embedding_state:  # also clears an earlier build's overrides
        kept = keep_embeddings_32bit(model if fp32_embedding_state else None)
    if builder is not None:
        if spec.model_factory is not None:  # refused with the lever's options; said plainly here
            raise EffitrainError(
                f"--optim {spec.name} is built over the whole model, not one parameter at a time"
            )
        optimizer = builder(groups, spec, lr)
    elif spec.model_factory is not None:
        optimizer = spec.model_factory(model, groups, lr)
    else:
        optimizer = spec.factory(groups, lr)
    if fp32_embedding_state:  # the banner's split line (as Muon's and GaLore's)
        optimizer.split_description = (
            f"32-bit state for the embedding weights ({kept:,} params), 8-bit for the "
            "other tensors of 4096+ elements"
        )
    return optimizer


def for_sharding(spec: OptimizerSpec, dtensor_params: bool) -> OptimizerSpec:
    """The spec to build when the optimizer will see FSDP2's DTensor parameters: the factored
    optimizers become :mod:`effitrain.optim.fsdp2`'s classes (the libraries' own crash there),
    with the registry's hyperparameters; any other spec as it is."""
    from effitrain.distributed import FACTORED_OPTIMIZERS

    if not dtensor_params or spec.name not in FACTORED_OPTIMIZERS:
        return spec
    name, library_factory = spec.name, spec.factory

    def factory(groups: ParamGroups, lr: float) -> torch.optim.Optimizer:
        from effitrain.optim.fsdp2 import build

        return build(name, library_factory, groups, lr)

    return dataclasses.replace(
        spec,
        class_path=f"effitrain.optim.fsdp2 ({spec.class_path}, on each rank's FSDP2 shard)",
        factory=factory,
    )


_BNB_OVERRIDES: set[int] = set()
"""``id()`` of the parameters whose bitsandbytes config effitrain overrode (see below)."""


def embedding_weights(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The trainable weights of ``model``'s ``nn.Embedding`` modules, each once (tied ones too)."""
    import torch

    found = {
        id(module.weight): module.weight
        for module in model.modules()
        if isinstance(module, torch.nn.Embedding) and module.weight.requires_grad
    }
    return list(found.values())


def keep_embeddings_32bit(model: torch.nn.Module | None) -> int:
    """Make bitsandbytes' 8-bit optimizers keep 32-bit state for ``model``'s embedding weights.

    This is what ``Trainer.create_optimizer`` does for every bitsandbytes 8-bit optimizer, and
    what bitsandbytes recommends for stable NLP training. Its ``GlobalOptimManager`` is one per
    process and keyed by ``id(parameter)``, and it reads the override at every step, so the
    overrides of an earlier build in this process are removed first (a freed parameter's id can
    be reused). ``None``: only that removal. Returns the number of parameters overridden.
    """
    from bitsandbytes.optim import GlobalOptimManager

    manager = GlobalOptimManager.get_instance()
    for key in _BNB_OVERRIDES:
        manager.pid2config.pop(key, None)
    _BNB_OVERRIDES.clear()
    if model is None:
        return 0
    weights = embedding_weights(model)
    for weight in weights:
        manager.override_config(weight, "optim_bits", 32)
        _BNB_OVERRIDES.add(id(weight))
    return sum(weight.numel() for weight in weights)


def build_scheduler(
    optimizer: torch.optim.Optimizer, name: str, total_steps: int, warmup_steps: int
) -> torch.optim.lr_scheduler.LRScheduler:
    """Warmup, then ``name`` ('linear', 'cosine' or 'constant') over ``total_steps`` steps."""
    from transformers import get_scheduler

    # transformers' 'constant' has no warmup; ours always warms up.
    hf_name = {"constant": "constant_with_warmup"}.get(name, name)
    return get_scheduler(
        hf_name, optimizer, num_warmup_steps=warmup_steps, num_training_steps=total_steps
    )
