"""The causal-LM loss: token-weighted across micro-batches and processes, and computed without
ever holding the full logits (``--chunked-loss``).

**Without the full logits.** A causal LM's output layer turns each position's hidden state into
one score per vocabulary entry; for a 150k-entry vocabulary the fp32 logits of 2,048 tokens are
1.2 GB, and their log-softmax and gradient as much again. Here the output layer computes the loss
instead of the logits, for the duration of the forward: it takes the last hidden states and its
own weight chunk by chunk:

- ``liger``: liger-kernel's fused linear cross-entropy (Triton, CUDA);
- ``cce``: Apple's cut-cross-entropy (Triton, CUDA);
- ``torch``: the pure-PyTorch form here, for any device: forward computes each chunk's logits,
  reduces them to a loss sum and drops them; backward recomputes one chunk at a time and adds
  its gradients into one buffer per input. A chunk holds about as many logits as the hidden
  states have values, and at least 128 MiB of them (:func:`chunk_tokens`), so the loss's
  memory no longer grows with the vocabulary.

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

import contextlib
import functools
import math
from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

import effitrain.tasks.document_attention as document_attention
from effitrain.errors import EffitrainError
from effitrain.tasks.base import LossMoments
from effitrain.tasks.lm_data import IGNORE_INDEX

if TYPE_CHECKING:
    import torch
    from accelerate import Accelerator

KERNELS = {"liger": "liger-kernel", "cce": "cut-cross-entropy"}
"""The CUDA implementations, by the package that provides each."""
LOGIT_SCALES = ("logit_scale", "logits_scaling", "output_multiplier_scale")
"""Config fields of models that rescale their logits after the output layer (Cohere, Granite,
Falcon-H1): the chunked loss would skip that. Final-logit softcapping (Gemma 2) is applied."""
MIN_CHUNK_VALUES = 2**25
"""Logit values a chunk holds at least (128 MiB in fp32): smaller chunks only add time."""
SETTLED = 1
"""From the second chunk on, each starts with the previous one's losses, logits and their
gradient alive, until its own replace them: on fake tensors those chunks of one width are
interchangeable (:func:`effitrain.cost.one_of_each_kind`)."""


@dataclass(frozen=True)
class Choice:
    """Which loss runs: ``name`` is a ``--chunked-loss`` value but ``auto``; ``why`` explains
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


def choose(
    wanted: str, model: torch.nn.Module, device: torch.device, sharded: str | None
) -> Choice:
    """The implementation for ``wanted`` (``--chunked-loss``: auto, torch, liger, cce or off)
    on this model, device and launch (``sharded``: FSDP's or DeepSpeed's description, None when
    parameters are whole).

    Raises:
        EffitrainError: an explicit choice that cannot run here.
    """
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
    config = _text_config(model)
    for field in LOGIT_SCALES:
        if getattr(config, field, None) not in (None, 1, 1.0):
            return f"this model rescales its logits after the output layer ({field})"
    return ""


def _text_config(model: Any) -> Any:
    """The config of the language model inside ``model`` (a multimodal model nests one)."""
    config = model.config
    return getattr(config, "get_text_config", lambda: config)()


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
    liger-kernel sizes its chunks), but at least :data:`MIN_CHUNK_VALUES` logits."""
    vocab_size = max(vocab_size, 1)
    return max(1, math.ceil(tokens * hidden_size / vocab_size), MIN_CHUNK_VALUES // vocab_size)


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

    return losses_from_logits(F.linear(hidden, weight, bias), labels, softcap)


@functools.cache
def _linear_cross_entropy() -> Any:
    """The torch form as an autograd Function (built on first use: torch is imported lazily).

    Forward keeps no logits: per chunk, the logits, their loss sum, dropped. Backward recomputes
    each chunk's logits, takes the loss's gradient with respect to them (autograd, on the chunk
    alone) and adds that chunk's share into one gradient buffer per input, so no full-size
    weight gradient is made per chunk. With ``per_token`` it returns each token's loss (``[tokens]``,
    fp32: as small as the labels) instead of their sum, for per-sequence sums.

    On fake tensors (the estimate) one chunk of each kind runs, counted for all (:data:`SETTLED`);
    not in the per-token forward, whose chunks' losses all stay alive."""
    import torch
    from torch._subclasses.fake_tensor import is_fake

    from effitrain.cost import Repeated, one_of_each_kind

    def chunks(hidden: torch.Tensor, size: int) -> list[tuple[int, int, int]]:
        """(start, width, times) of the chunks of ``hidden.split(size)`` to run."""
        found = [(start, min(size, len(hidden) - start)) for start in range(0, len(hidden), size)]
        return one_of_each_kind(found, SETTLED, bool(is_fake(hidden)))

    class LinearCrossEntropy(torch.autograd.Function):
        @staticmethod
        def forward(ctx, hidden, weight, bias, labels, softcap, size, per_token=False):
            hiddens, targets = hidden.split(size), labels.split(size)
            if per_token:  # one chunk's logits at a time
                pairs = zip(hiddens, targets, strict=True)
                total = torch.cat([_token_losses(h, weight, bias, t, softcap) for h, t in pairs])
            else:
                total = torch.zeros((), device=hidden.device, dtype=torch.float32)
                for start, _, times in chunks(hidden, size):
                    with Repeated(times):  # one chunk's logits at a time
                        index = start // size
                        piece = _token_losses(hiddens[index], weight, bias, targets[index], softcap)
                        total += piece.sum()
            ctx.save_for_backward(hidden, weight, bias, labels)
            ctx.softcap, ctx.size, ctx.per_token = softcap, size, per_token
            kind = hidden.device.type
            ctx.autocast = (kind, torch.is_autocast_enabled(kind), torch.get_autocast_dtype(kind))
            return total

        @staticmethod
        def backward(ctx, grad_total):
            hidden, weight, bias, labels = ctx.saved_tensors
            kind, enabled, dtype = ctx.autocast
            grad_h = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
            grad_w = torch.zeros_like(weight) if ctx.needs_input_grad[1] else None
            grad_b = torch.zeros_like(bias) if ctx.needs_input_grad[2] else None
            hiddens, targets = hidden.split(ctx.size), labels.split(ctx.size)
            for start, _, times in chunks(hidden, ctx.size):
                h, t = hiddens[start // ctx.size], targets[start // ctx.size]
                with Repeated(times):
                    with torch.enable_grad(), torch.autocast(kind, dtype=dtype, enabled=enabled):
                        raw = torch.nn.functional.linear(h, weight, bias).detach().requires_grad_()
                        losses = losses_from_logits(raw, t, ctx.softcap)
                        if not ctx.per_token:
                            losses = losses.sum()
                    # With per_token, each token's loss has its own incoming gradient.
                    grad = grad_total[start : start + len(h)] if ctx.per_token else grad_total
                    (d_raw,) = torch.autograd.grad(losses, raw, grad)
                    if grad_h is not None:
                        grad_h[start : start + len(h)] = d_raw @ weight.to(d_raw.dtype)
                    if grad_w is not None:
                        grad_w.addmm_(d_raw.T.to(weight.dtype), h.to(weight.dtype))
                    if grad_b is not None:
                        grad_b += d_raw.sum(dim=0).to(bias.dtype)
            return grad_h, grad_w, grad_b, None, None, None, None

    return LinearCrossEntropy


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
    return _linear_cross_entropy().apply(flat, weight, bias, targets, softcap, size)


def chunked_token_losses(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    labels: torch.Tensor,
    softcap: float | None = None,
) -> torch.Tensor:
    """Each token's loss (``labels``' shape, fp32, 0 where ignored) from ``hidden``
    (``[..., hidden]``) against ``labels`` (already shifted), without the full logits: the torch
    form of :func:`chunked_loss_sum`. Differentiable in ``hidden``, ``weight`` and ``bias``."""
    flat, targets = hidden.reshape(-1, hidden.shape[-1]), labels.reshape(-1)
    size = chunk_tokens(flat.shape[0], flat.shape[1], weight.shape[0])
    losses = _linear_cross_entropy().apply(flat, weight, bias, targets, softcap, size, True)
    return losses.view(labels.shape)


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
                losses.append(losses_from_logits(h, t, softcap))
            else:
                losses.append(_token_losses(h, weight, bias, t, softcap))
    return torch.cat(losses).view(batch, length).sum(dim=-1)


def losses_from_logits(
    logits: torch.Tensor, labels: torch.Tensor, softcap: float | None
) -> torch.Tensor:
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
    config = _text_config(model)
    return getattr(config, "final_logit_softcapping", None) or None


class ChosenLoss(LossMoments):
    """A loss computed by a :class:`Choice`: its name and levers in the metrics JSON."""

    choice: Choice

    @property
    def name(self) -> str:
        return self.choice.name

    @property
    def chunked(self) -> bool:
        return self.choice.chunked


class LMLoss(ChosenLoss):
    """The causal-LM training loss and evaluation sums, with the chosen implementation.

    ``model`` arguments may be wrapped (DDP); ``unwrapped`` is the model itself."""

    token_weighted = True

    def __init__(self, choice: Choice, unwrapped: Any):
        self.choice = choice
        self.unwrapped = unwrapped
        self.softcap = softcap_of(unwrapped)
        self.documents = document_attention.in_use(unwrapped)

    def describe(self) -> list[str]:
        return [
            self.choice.describe(),
            "loss weighted by labelled tokens: each optimizer step's loss is the mean over all "
            "its labelled tokens, on every micro-batch and process",
        ]

    def to_dict(self) -> dict[str, Any]:
        return {"implementation": self.name, "weighting": "tokens", "why": self.choice.why}

    def window_metrics(self, accelerator: Accelerator) -> dict[str, float]:
        """None: the loss is all the log line says."""
        return {}

    def model_inputs(self, batch: dict[str, Any]) -> dict[str, Any]:
        """What the model is called with: the batch less its labels, and less its document
        lengths where the model's attention does not take them."""
        dropped = {"labels", "shift_labels", document_attention.LENGTHS_KEY}
        if self.documents:
            dropped.discard(document_attention.LENGTHS_KEY)
        return {k: v for k, v in batch.items() if k not in dropped}

    def attending(self, inputs: dict[str, Any]) -> AbstractContextManager[None]:
        """Around the model's forward: no mask built where the documents' lengths are given."""
        given = document_attention.LENGTHS_KEY in inputs
        return document_attention.documents_given() if given else contextlib.nullcontext()

    def __call__(self, model: Any, batch: dict[str, Any]) -> torch.Tensor:
        """The micro-batch's sum of token losses (fp32); ``shift_labels``, where the batch has
        them, are its labels already shifted (a context-parallel rank's share of them)."""
        inputs = self.model_inputs(batch)
        labels = batch.get("shift_labels")
        labels = shifted_labels(batch["labels"]) if labels is None else labels
        if not self.choice.chunked:  # the model's logits are final: softcapped where it caps
            with self.attending(inputs):
                logits = model(**inputs).logits
            return losses_from_logits(
                logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), None
            ).sum()

        def loss_sum(hidden: torch.Tensor, head: Any) -> torch.Tensor:
            return chunked_loss_sum(
                self.choice, hidden, head.weight, head.bias, labels, self.softcap
            )

        with loss_in_output_layer(self.unwrapped, loss_sum) as result, self.attending(inputs):
            model(**inputs)
        return result.value

    def sequence_sums(self, model: Any, batch: dict[str, Any]) -> torch.Tensor:
        """Each sequence's sum of token losses, never holding the batch's full fp32 logits."""
        import torch

        inputs = self.model_inputs(batch)
        labels = shifted_labels(batch["labels"])
        with torch.no_grad(), self.attending(inputs):
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
    averaging by their number; both are undone here. One all-reduce, no host sync. Under
    context parallelism the N ranks of a group read the same batches, each training on its
    share of their tokens: the sum counts each token N times.
    """
    import torch

    tokens = torch.stack([labelled_tokens(b) for b in batches]).sum().to(torch.float32)
    if accelerator.num_processes > 1:
        tokens = accelerator.reduce(tokens, "sum")
        parallelism = getattr(accelerator, "parallelism_config", None)
        if parallelism is not None and parallelism.cp_enabled:
            tokens = tokens / parallelism.cp_size
    factor = accelerator.num_processes * accelerator.gradient_accumulation_steps
    return factor / tokens.clamp(min=1)
