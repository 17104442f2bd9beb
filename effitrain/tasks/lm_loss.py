"""The causal-LM loss: token-weighted across micro-batches and processes, and computed without
ever holding the full logits (``--chunked-loss``).

**Without the full logits.** A causal LM's output layer turns each position's hidden state into
one score per vocabulary entry; for a 150k-entry vocabulary the fp32 logits of 2,048 tokens are
1.2 GB, and their log-softmax and gradient as much again. Here the output layer computes the loss
instead of the logits, for the duration of the forward: it takes the last hidden states and its
own weight chunk by chunk:

- ``liger``: liger-kernel's fused linear cross-entropy (Triton, CUDA);
- ``cce``: Apple's cut-cross-entropy (Triton, CUDA);
- ``torch``: the pure-PyTorch form here, for any device: each chunk's logits are computed,
  reduced to a loss sum and dropped, under activation checkpointing, so backward recomputes one
  chunk at a time. A chunk holds about as many logits as the hidden states have values
  (:func:`chunk_tokens`), so the loss's memory no longer grows with the vocabulary.

This runs inside the model's own forward, so a DDP wrapper, autocast and the model's hooks see
the usual call. It is refused where the output layer is not a plain Linear
layer (LoRA on it), under FSDP or DeepSpeed (the sharded output weight is only whole inside the
forward), and where the model rescales its logits after the output layer in a way the loss does
not reproduce (:data:`LOGIT_SCALES`); ``auto`` then keeps the model's own logits and says why.

**Token-weighted.** Every labelled token of an optimizer step weighs the same, however the step's
tokens fall into micro-batches and processes: each micro-batch's loss is its sum of token losses
over the step's labelled-token count on all processes (one all-reduce per step), times the
factors by which the backward pass and the processes' gradient averaging divide. The gradient is
then that of one big batch; a per-micro-batch mean would give a micro-batch with few labelled
tokens (short texts, padding, completion-only masks) the same weight as a full one.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

from effitrain.errors import EffitrainError
from effitrain.tasks.lm_data import IGNORE_INDEX

if TYPE_CHECKING:
    import torch

    from effitrain.config import TrainConfig

KERNELS = {"liger": "liger-kernel", "cce": "cut-cross-entropy"}
"""The CUDA implementations, by the package that provides each."""
LOGIT_SCALES = ("logit_scale", "logits_scaling", "output_multiplier_scale")
"""Config fields of models that rescale their logits after the output layer (Cohere, Granite,
Falcon-H1): the chunked loss would skip that. Final-logit softcapping (Gemma 2) is applied."""
MIN_CHUNK_TOKENS = 64
"""Fewer tokens per chunk only add per-chunk overhead."""


@dataclass(frozen=True)
class Choice:
    """Which loss runs: ``name`` is one of ``effitrain.config.CHUNKED_LOSS`` but ``auto``; ``why`` explains
    ``off`` chosen by ``auto`` (for the banner)."""

    name: str
    why: str = ""

    @property
    def chunked(self) -> bool:
        return self.name != "off"

    def describe(self) -> str:
        """The banner's line."""
        if self.name == "torch":
            return (
                "chunked loss (torch): the output layer and the loss run chunk by chunk, "
                "recomputed in backward; the full logits are never held"
            )
        if self.name in KERNELS:
            return f"chunked loss ({KERNELS[self.name]}'s fused linear cross-entropy)"
        return "full logits (the model's output layer, then the loss)" + (
            f": {self.why}" if self.why else ""
        )


def choose(config: TrainConfig, model: Any, device: Any, sharded: str | None) -> Choice:
    """The implementation for this model, device and launch (``sharded``: FSDP's or
    DeepSpeed's description, None when parameters are whole).

    Raises:
        EffitrainError: an explicit choice that cannot run here.
    """
    wanted = config.chunked_loss or "auto"
    if wanted == "off":
        return Choice("off")
    problem = _unsupported(model, sharded)
    if problem:
        if wanted == "auto":
            return Choice("off", problem)
        raise EffitrainError(
            f"--chunked-loss {wanted} cannot run: {problem}; use --chunked-loss off"
        )
    if wanted == "auto":
        for name in KERNELS:
            if device.type == "cuda" and _kernel(name) is not None:
                return Choice(name)
        return Choice("torch")
    if wanted in KERNELS:
        if device.type != "cuda":
            raise EffitrainError(
                f"--chunked-loss {wanted} is a CUDA (Triton) kernel and this run's device is "
                f"{device.type}; use --chunked-loss torch (any device) or auto"
            )
        if _kernel(wanted) is None:
            raise EffitrainError(
                f"--chunked-loss {wanted} needs {KERNELS[wanted]}: pip install {KERNELS[wanted]}"
            )
    return Choice(wanted)


def _unsupported(model: Any, sharded: str | None) -> str:
    """Why the chunked loss cannot run on ``model`` (unwrapped), or ''."""
    import torch

    if sharded:
        return f"the output layer's weight is sharded under {sharded}"
    head = model.get_output_embeddings()
    if type(head) is not torch.nn.Linear:
        return f"the output layer is a {type(head).__name__}, not a plain Linear layer"
    config = model.config
    config = getattr(config, "get_text_config", lambda: config)()
    for field in LOGIT_SCALES:
        if getattr(config, field, None) not in (None, 1, 1.0):
            return f"this model rescales its logits after the output layer ({field})"
    return ""


def _kernel(name: str) -> Any:
    """The fused kernel's function, or None where its package is not installed."""
    try:
        if name == "liger":
            from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

            return liger_fused_linear_cross_entropy
        from cut_cross_entropy import linear_cross_entropy

        return linear_cross_entropy
    except ImportError:
        return None


def chunk_tokens(tokens: int, hidden_size: int, vocab_size: int) -> int:
    """Tokens per chunk: a chunk's logits about as large as all the hidden states (as
    liger-kernel sizes its chunks), at least :data:`MIN_CHUNK_TOKENS`."""
    return max(MIN_CHUNK_TOKENS, math.ceil(tokens * hidden_size / max(vocab_size, 1)))


def shifted_labels(labels: torch.Tensor) -> torch.Tensor:
    """Position t predicts token t + 1, as the models' own loss shifts them; the last position
    predicts nothing."""
    import torch.nn.functional as F

    return F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)


def labelled_tokens(batch: dict[str, Any]) -> torch.Tensor:
    """The batch's tokens that have a label after the shift (a device tensor: no sync)."""
    return (batch["labels"][:, 1:] != IGNORE_INDEX).sum()


def _token_losses(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    labels: torch.Tensor,
    softcap: float | None,
) -> torch.Tensor:
    """Per-token fp32 losses of one chunk (ignored labels give 0), as the models' loss computes
    them: logits upcast to fp32, then cross-entropy."""
    import torch.nn.functional as F

    return _from_logits(F.linear(hidden, weight, bias), labels, softcap)


def _chunk_sum(hidden, weight, bias, labels, softcap):  # type: ignore[no-untyped-def]
    return _token_losses(hidden, weight, bias, labels, softcap).sum()


def chunked_loss_sum(
    choice: Choice,
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    labels: torch.Tensor,
    softcap: float | None = None,
) -> torch.Tensor:
    """The sum of the token losses of ``hidden`` (``[..., hidden]``) against ``labels`` (already
    shifted), without the full logits. Differentiable in ``hidden``, ``weight`` and ``bias``."""
    import torch
    from torch.utils.checkpoint import checkpoint

    flat, targets = hidden.reshape(-1, hidden.shape[-1]), labels.reshape(-1)
    if choice.name == "liger":
        return _kernel("liger")(
            flat, weight, targets, bias, ignore_index=IGNORE_INDEX, reduction="sum", softcap=softcap
        )
    if choice.name == "cce":
        if bias is not None:
            raise EffitrainError(
                "--chunked-loss cce takes no output-layer bias; use liger or torch"
            )
        return _kernel("cce")(
            flat, weight, targets, ignore_index=IGNORE_INDEX, softcap=softcap, reduction="sum"
        )
    size = chunk_tokens(flat.shape[0], flat.shape[1], weight.shape[0])
    total = torch.zeros((), device=flat.device, dtype=torch.float32)
    for h, t in zip(flat.split(size), targets.split(size), strict=True):
        total = total + checkpoint(_chunk_sum, h, weight, bias, t, softcap, use_reentrant=False)
    return total


def sequence_loss_sums(
    hidden: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    labels: torch.Tensor,
    softcap: float | None = None,
) -> torch.Tensor:
    """Each sequence's sum of token losses (``[batch]``, fp32), chunk by chunk, for evaluation
    (no gradient: nothing is kept but the sums). With ``weight`` None, ``hidden`` are the
    logits themselves: then only their fp32 upcast and log-softmax are chunked."""
    import torch

    batch, length = labels.shape
    flat, targets = hidden.reshape(batch * length, -1), labels.reshape(-1)
    if weight is None:
        size = chunk_tokens(flat.shape[0], 1, flat.shape[1])
    else:
        size = chunk_tokens(flat.shape[0], flat.shape[1], weight.shape[0])
    losses = []
    with torch.no_grad():
        for h, t in zip(flat.split(size), targets.split(size), strict=True):
            if weight is None:
                losses.append(_from_logits(h, t, softcap))
            else:
                losses.append(_token_losses(h, weight, bias, t, softcap))
    return torch.cat(losses).view(batch, length).sum(dim=-1)


def _from_logits(logits: torch.Tensor, labels: torch.Tensor, softcap: float | None) -> torch.Tensor:
    """Per-token fp32 losses from logits (ignored labels give 0)."""
    import torch
    import torch.nn.functional as F

    logits = logits.float()
    if softcap:
        logits = torch.tanh(logits / softcap) * softcap
    return F.cross_entropy(logits, labels, ignore_index=IGNORE_INDEX, reduction="none")


@contextmanager
def loss_in_output_layer(model: Any, compute: Callable[[Any, Any], Any]) -> Iterator[Any]:
    """For the duration, the model's output layer returns ``compute(hidden_states, layer)``
    instead of the logits; yields a holder whose ``value`` is what it computed.

    Inside the model's own forward, so autocast, a DDP wrapper and the model's hooks see the
    usual call. The holder, not the forward's output, carries the result: a model that
    post-processes its logits (softcapping) would change the returned one."""
    head = model.get_output_embeddings()
    holder = SimpleNamespace(value=None)

    def forward(hidden: torch.Tensor) -> Any:
        holder.value = compute(hidden, head)
        return holder.value

    head.forward = forward  # an instance attribute: Module.__call__ finds it first
    try:
        yield holder
    finally:
        del head.forward


def softcap_of(model: Any) -> float | None:
    """The model's final-logit softcapping (Gemma 2), applied by the loss after each chunk."""
    config = model.config
    config = getattr(config, "get_text_config", lambda: config)()
    return getattr(config, "final_logit_softcapping", None) or None


class LMLoss:
    """The causal-LM training loss and evaluation sums, with the chosen implementation.

    ``model`` arguments may be wrapped (DDP); ``unwrapped`` is the model itself."""

    token_weighted = True

    def __init__(self, choice: Choice, unwrapped: Any):
        self.choice = choice
        self.unwrapped = unwrapped
        self.softcap = softcap_of(unwrapped)

    @property
    def name(self) -> str:
        return self.choice.name

    @property
    def levers(self) -> list[str]:
        return ["chunked-loss"] if self.choice.chunked else []

    def describe(self) -> list[str]:
        return [
            self.choice.describe(),
            "loss weighted by labelled tokens: each optimizer step's loss is the mean over all "
            "its labelled tokens, on every micro-batch and process",
        ]

    def to_dict(self) -> dict[str, Any]:
        return {"implementation": self.name, "weighting": "tokens", "why": self.choice.why}

    def __call__(self, model: Any, batch: dict[str, Any]) -> torch.Tensor:
        """The micro-batch's sum of token losses (fp32)."""
        inputs = {k: v for k, v in batch.items() if k != "labels"}
        labels = shifted_labels(batch["labels"])
        if not self.choice.chunked:  # the model's logits are final: softcapped where it caps
            logits = model(**inputs).logits
            return _from_logits(
                logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), None
            ).sum()

        def loss_sum(hidden: torch.Tensor, head: Any) -> torch.Tensor:
            return chunked_loss_sum(
                self.choice, hidden, head.weight, head.bias, labels, self.softcap
            )

        with loss_in_output_layer(self.unwrapped, loss_sum) as result:
            model(**inputs)
        return result.value

    def sequence_sums(self, model: Any, batch: dict[str, Any]) -> torch.Tensor:
        """Each sequence's sum of token losses, never holding the batch's full fp32 logits."""
        import torch

        inputs = {k: v for k, v in batch.items() if k != "labels"}
        labels = shifted_labels(batch["labels"])
        with torch.no_grad():
            if not self.choice.chunked:
                return sequence_loss_sums(model(**inputs).logits, None, None, labels)

            def sums(hidden: torch.Tensor, head: Any) -> torch.Tensor:
                return sequence_loss_sums(hidden, head.weight, head.bias, labels, self.softcap)

            with loss_in_output_layer(self.unwrapped, sums) as result:
                model(**inputs)
            return result.value


def step_scale(batches: Iterable[dict[str, Any]], accelerator: Any) -> torch.Tensor:
    """The factor that turns each micro-batch's loss sum into its share of the step's
    token-mean loss: (processes x micro-batches per step) / labelled tokens on all processes.

    ``accelerator.backward`` divides by the accumulation steps and the processes' gradient
    averaging by their number; both are undone here. One all-reduce, no host sync.
    """
    import torch

    tokens = torch.stack([labelled_tokens(b) for b in batches]).sum().to(torch.float32)
    if accelerator.num_processes > 1:
        tokens = accelerator.reduce(tokens, "sum")
    factor = accelerator.num_processes * accelerator.gradient_accumulation_steps
    return factor / tokens.clamp(min=1)
