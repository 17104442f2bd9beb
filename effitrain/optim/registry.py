"""The optimizer table: name -> :class:`.OptimizerSpec` (its factory in :mod:`.factories`, its
defaults, the state it keeps), the measured state bytes beside it, and the look-ups that refuse
an unknown name by listing the valid ones.

Nothing heavy is imported here (each library is, inside its factory): ``effitrain optimizers``
and ``--help`` stay instant.
"""

from __future__ import annotations

import functools
import json
from typing import TYPE_CHECKING, Any

import effitrain.optim.factories as factories
from effitrain.errors import EffitrainError
from effitrain.optim.optimizer_spec import Defaults, OptimizerSpec

if TYPE_CHECKING:
    from effitrain.config import TrainConfig

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
            factory=factories.adamw,
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
            factory=factories.adafactor,
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
            factory=factories.adafactor_hf,
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
            factory=factories.adamw_8bit,
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
            factory=factories.sgd,
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
            factory=factories.adamw,  # unused: model_factory builds it (it partitions by name)
            model_factory=factories.adam_mini,
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
            factory=factories.by_model_only,
            model_factory=factories.muon,
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
            factory=factories.by_model_only,
            caveat="from scratch it learns slowly (docs/optimizers.md)",
            model_factory=factories.galore,
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
            factory=factories.by_model_only,
            model_factory=factories.apollo,
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
            factory=factories.by_model_only,
            model_factory=factories.apollo_mini,
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
            factory=factories.lion,
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
            factory=factories.lion_8bit,
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
            factory=factories.came,
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
            factory=factories.adamw_schedule_free,
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
            factory=factories.torchao("AdamW8bit"),
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
            factory=factories.torchao("AdamW4bit"),
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
            factory=factories.torchao("AdamWFp8"),
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
