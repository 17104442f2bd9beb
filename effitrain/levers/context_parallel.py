"""Context parallelism (``--context-parallel N``; or ``parallelism_config_cp_size`` in the
accelerate config file the run is launched with): each sequence split across N ranks, through
Accelerate's ``ParallelismConfig(cp_size=N)`` on FSDP2 and PyTorch's ring attention
(``torch.distributed.tensor.experimental.context_parallel``).

What each micro-batch goes through (:func:`sharded_batch`, around its forward and backward):
the labels are shifted first (a shard cannot shift into the next rank's tokens), the true
positions are given as ``position_ids`` (the ranks' shards are not contiguous: Accelerate's
load balancer gives rank r chunks r and 2N-1-r of 2N, so that causal attention costs each rank
the same), the padding mask is dropped (ring attention takes none: with right padding a real
token never attends to a pad under the causal mask, and pads carry no label), then
``accelerator.maybe_context_parallel`` shards ``input_ids``, the shifted labels and the
positions in place. The loss stays the token mean of the whole sequence: each rank sums its
shard's token losses and the step's labelled tokens are counted once per sequence, not once per
rank (:func:`effitrain.tasks.lm_loss.step_scale`); FSDP2 averages the gradients over every rank
of its mesh (Accelerate's ``dp_shard_cp``: data-parallel shards times the CP ranks).

What it cannot run with (refused in one line): a launch other than FSDP2, N not dividing the
processes, a ``--max-length`` not divisible by 2N (the load balancer's chunks), packed blocks
(ring attention takes no per-document mask), left padding, another task than causal-lm, a
model whose attention is not SDPA or not full causal (sliding-window, chunked, linear), and the
CPU: PyTorch's ring attention handles only CUDA's SDPA kernels (flash, memory-efficient,
cuDNN); on the CPU, SDPA's kernel has no sharding rule (tried on torch 2.13, gloo).

``effitrain estimate`` runs its fake step on one rank's share of the sequence (L/N tokens) and
adds what ring attention holds besides (:class:`GatheredKV`): the other ranks' keys and values,
all-gathered for each layer's attention (Accelerate's default rotation, ``allgather``).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from effitrain.config import MEMORY_LEVERS, OptionGroup, option_field
from effitrain.errors import EffitrainError
from effitrain.levers.spec import Lever
from effitrain.models import DOCUMENT_ATTENTION, DOCUMENT_LENGTHS

if TYPE_CHECKING:
    from contextlib import AbstractContextManager

    import torch

    from effitrain.config import TrainConfig
    from effitrain.distributed import Launch
    from effitrain.parts import RunParts

ENVIRONMENT = "PARALLELISM_CONFIG_CP_SIZE"
"""Where ``accelerate launch`` puts an accelerate config file's ``parallelism_config_cp_size``."""
IGNORED = -100
"""The label nothing is trained on: PyTorch's cross-entropy ``ignore_index``, as the causal-LM
task's ``IGNORE_INDEX`` (effitrain.tasks.lm_data, a layer above the levers)."""


@dataclass
class ContextParallelOptions(OptionGroup):
    """``--context-parallel``."""

    context_parallel: int | None = option_field(
        None,
        "causal-lm under FSDP2 on CUDA: split each sequence across N ranks (ring attention, "
        "Accelerate's ParallelismConfig cp_size); default: the accelerate config's cp_size, "
        "else 1.",
        panel=MEMORY_LEVERS,
        metavar="N",
    )


def from_environment() -> int | None:
    """The cp size the launch's accelerate config file gave (None: none given)."""
    value = os.environ.get(ENVIRONMENT, "")
    try:
        return int(value) if value else None
    except ValueError:
        raise EffitrainError(f"{ENVIRONMENT}={value!r} is not a number of ranks") from None


def size(config: TrainConfig) -> int:
    """The ranks each sequence is split across: ``--context-parallel``, else the accelerate
    config's cp size, else 1.

    Raises:
        EffitrainError: the two are given and differ.
    """
    given, launched = ContextParallelOptions.of(config).context_parallel, from_environment()
    if given is not None and launched is not None and given != launched:
        raise EffitrainError(
            f"--context-parallel {given} but the accelerate config's cp_size is {launched}; "
            "give one of them"
        )
    return given or launched or 1


def rank_length(config: TrainConfig, length: int) -> int:
    """The tokens of a ``length``-token sequence that one rank holds."""
    return length // size(config)


def check_launch(config: TrainConfig, launch: Launch) -> None:
    """Refuse a launch that cannot split sequences: not CUDA, not FSDP2, N not dividing the
    processes.

    Raises:
        EffitrainError: one line naming the option and the launch.
    """
    n = size(config)
    if launch.device_type != "cuda":
        raise EffitrainError(
            f"--context-parallel {n} needs CUDA: PyTorch's ring attention runs only CUDA's "
            f"attention kernels, and this run's device is {launch.device_words}"
        )
    if launch.sharding.kind != "fsdp2":
        raise EffitrainError(
            f"--context-parallel {n} needs FSDP2 (an accelerate config with "
            f"distributed_type: FSDP and fsdp_version: 2); this run is "
            f"{launch.sharding.description}"
        )
    if launch.num_processes % n:
        raise EffitrainError(
            f"--context-parallel {n} must divide the number of processes ({launch.num_processes})"
        )


def parallelism_config(config: TrainConfig) -> Any:
    """Accelerate's ``ParallelismConfig`` for the run (None: no context parallelism): the
    processes not in one CP group shard the model as FSDP (``dp_shard``). The launch is checked
    first, from its environment: Accelerate's own refusals are less clear.

    Raises:
        EffitrainError: the launch cannot split sequences (:func:`check_launch`).
    """
    n = size(config)
    if n <= 1:
        return None
    from accelerate.parallelism_config import ParallelismConfig

    from effitrain.distributed import launch_from_environment

    launch = launch_from_environment()
    check_launch(config, launch)
    return ParallelismConfig(
        dp_replicate_size=1, dp_shard_size=launch.num_processes // n, cp_size=n
    )


@contextmanager
def sharded_batch(accelerator: Any, batch: dict[str, Any]) -> Iterator[None]:
    """``batch`` cut to this rank's share of its sequence for the forward and backward inside
    (the module's docstring says how); its tensors stay sharded after."""
    import torch
    import torch.nn.functional as F

    ids = batch["input_ids"]
    # As the causal-LM loss shifts them (effitrain.tasks.lm_loss.shifted_labels), before the cut.
    batch["shift_labels"] = F.pad(batch["labels"][:, 1:], (0, 1), value=IGNORED)
    batch["position_ids"] = torch.arange(ids.shape[1], device=ids.device).repeat(ids.shape[0], 1)
    batch.pop("attention_mask", None)
    # The whole rows' documents: ring attention runs causal SDPA over the cut rows instead.
    batch.pop(DOCUMENT_LENGTHS, None)
    buffers = [ids, batch["shift_labels"], batch["position_ids"]]
    with accelerator.maybe_context_parallel(
        buffers=buffers, buffer_seq_dims=[1] * len(buffers), no_restore_buffers=set(buffers)
    ):
        yield


class GatheredKV:
    """``effitrain estimate``'s model of ring attention on one rank's share of the sequence:
    each scaled-dot-product attention holds the other ``ranks - 1`` ranks' keys and values
    while it runs, in forward and again in backward (all-gathered both times). Entered around
    every micro-batch, as the levers' step contexts are."""

    def __init__(self, ranks: int):
        self.ranks = ranks
        self._original: Any = None

    def _others(self, shape: Any, dtype: Any, device: Any) -> Any:
        import torch

        gathered = (*shape[:-2], shape[-2] * (self.ranks - 1), shape[-1])
        return torch.empty(gathered, dtype=dtype, device=device)

    def __enter__(self) -> None:
        import torch
        import torch.nn.functional as F

        original, others = F.scaled_dot_product_attention, self._others

        class Regathered(torch.autograd.Function):
            """Identity on the attention's output; its backward holds the gathered keys and
            values once more, just before the attention's own backward."""

            @staticmethod
            def forward(ctx: Any, out: Any, key: Any, value: Any) -> Any:
                ctx.kv = [(t.shape, t.dtype, t.device) for t in (key, value)]
                return out.view_as(out)

            @staticmethod
            def backward(ctx: Any, grad: Any) -> Any:
                held = [others(*kv) for kv in ctx.kv]
                del held
                return grad, None, None

        def ring(query: Any, key: Any, value: Any, *args: Any, **kwargs: Any) -> Any:
            held = [others(t.shape, t.dtype, t.device) for t in (key, value)]  # while it runs
            out = original(query, key, value, *args, **kwargs)
            del held
            return Regathered.apply(out, key, value)

        self._original = original
        F.scaled_dot_product_attention = ring

    def __exit__(self, *exc: Any) -> None:
        import torch.nn.functional as F

        F.scaled_dot_product_attention = self._original


class ContextParallel(Lever):
    name = "context-parallel"
    options = ContextParallelOptions
    removes = "activations: each rank holds 1/N of every sequence's tokens (and 1/N of the model)"
    task = "causal-lm"
    devices = ("cuda",)
    time_cost = "each layer's keys and values exchanged between the ranks (overlapped)"

    def is_on(self, config: TrainConfig) -> bool:
        return size(config) > 1

    def check(self, config: TrainConfig) -> None:
        given = ContextParallelOptions.of(config).context_parallel
        if given is not None and given < 1:
            raise EffitrainError(f"--context-parallel must be 1 or more (got {given})")
        n = size(config)
        if n <= 1:
            return
        if config.packing is not False:
            raise EffitrainError(
                f"--context-parallel {n} needs --no-packing: ring attention takes no "
                "per-document mask, so packed documents would attend to each other"
            )
        if config.max_length % (2 * n):
            raise EffitrainError(
                f"--context-parallel {n} needs --max-length divisible by {2 * n} (each rank "
                f"holds 2 of {2 * n} equal chunks, for load balance); got {config.max_length}"
            )

    def check_launch(self, config: TrainConfig, launch: Launch) -> None:
        check_launch(config, launch)

    def apply_to_model(
        self, model: torch.nn.Module, config: TrainConfig, device: torch.device | None
    ) -> torch.nn.Module:
        from effitrain.models import base_model

        base, n = base_model(model), size(config)
        if not getattr(base, "supports_context_parallel", True):
            raise EffitrainError(
                f"--context-parallel {n}: {type(base).__name__} cannot take it: ring attention "
                "is full causal attention, and this model's layers use sliding-window, chunked "
                "or linear attention"
            )
        implementation = getattr(base.config, "_attn_implementation", None) or "sdpa"
        # Document attention calls SDPA itself where the batch has no document lengths (cut).
        if implementation not in ("sdpa", DOCUMENT_ATTENTION):
            raise EffitrainError(
                f"--context-parallel {n} needs PyTorch's SDPA attention (ring attention takes its "
                f"place); this model's is {implementation}"
            )
        return model

    def after_prepare(self, run: RunParts) -> None:
        side = getattr(run.tokenizer, "padding_side", "right")
        if side == "left":
            raise EffitrainError(
                f"--context-parallel {size(run.config)} drops the padding mask (ring attention "
                "takes none), so rows must be padded on the right; this tokenizer pads on the left"
            )

    def step_context(
        self, config: TrainConfig, model: torch.nn.Module, estimating: bool
    ) -> AbstractContextManager[Any] | None:
        return GatheredKV(size(config)) if estimating else None

    def batch_context(
        self, run: RunParts, batch: dict[str, Any]
    ) -> AbstractContextManager[Any] | None:
        parallelism = getattr(run.accelerator, "parallelism_config", None)
        if parallelism is None or not parallelism.cp_enabled:  # an estimate: one rank's share
            return None
        return sharded_batch(run.accelerator, batch)

    def banner(self, config: TrainConfig, model: torch.nn.Module) -> str:
        return (
            f"context parallelism: each sequence split across {size(config)} ranks (ring "
            "attention, Accelerate's ParallelismConfig over FSDP2)"
        )

    def estimate_notes(self, config: TrainConfig) -> list[str]:
        n = size(config)
        return [
            f"--context-parallel {n}: the step runs on one rank's share of each sequence "
            f"(--max-length / {n} tokens), with the other ranks' keys and values gathered "
            "around each attention; its FLOPs count attention within that share only"
        ]
