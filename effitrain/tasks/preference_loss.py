"""The preference losses (DPO, ORPO, SimPO) as TRL computes them, on the per-sequence log-probs
of one forward over the concatenated chosen and rejected rows, never holding the full logits
with ``--chunked-loss``.

**Log-probs.** A sequence's log-prob is the sum of its answer tokens' log-probs, the negative
of their token losses: the causal-LM loss's machinery (:mod:`effitrain.tasks.lm_loss`) computes
them inside the output layer. The torch form returns each token's loss (as small as the labels)
and the sums are masked from it; the CUDA kernels give one sum per call, so they run once per
row (liger, which keeps a weight-sized gradient per call, only where the output weight is frozen:
:func:`per_sequence_choice`).

**The losses** (``b`` = beta, ``c``/``r`` = chosen/rejected log-prob, ``ref`` the reference's):

- ``dpo`` (TRL's DPOTrainer, loss_type sigmoid): ``-logsigmoid(b * ((c - ref_c) - (r - ref_r)))``;
  with ``--label-smoothing e`` the conservative form, ``-(1-e)*logsigmoid(b*d) - e*logsigmoid(-b*d)``;
- ``orpo`` (TRL's ORPOTrainer): the chosen rows' NLL, a token mean over every non-padding token
  of prompt and answer (as TRL computes it), minus ``b * logsigmoid(log odds)`` of the average
  log-probs;
- ``simpo`` (TRL's CPOTrainer, loss_type simpo, cpo_alpha 0):
  ``-logsigmoid(b * (c_avg - r_avg) - gamma)`` on average log-probs.

Each is a mean over the micro-batch's pairs (as TRL), so every micro-batch weighs the same.
The rewards TRL logs (``rewards/*``, ``logps/*``) are summed on the device over the log window
and averaged over its pairs on all processes when a log line is made.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, NamedTuple

from effitrain.errors import EffitrainError
from effitrain.tasks.lm_data import IGNORE_INDEX
from effitrain.tasks.lm_loss import (
    Choice,
    ChosenLoss,
    chunked_loss_sum,
    chunked_token_losses,
    loss_in_output_layer,
    losses_from_logits,
    shifted_labels,
    softcap_of,
)

if TYPE_CHECKING:
    from pathlib import Path

    import torch
    from accelerate import Accelerator

    from effitrain.config import TrainConfig
    from effitrain.parts import RunParts
    from effitrain.report.live import Reporter
    from effitrain.tasks.reference_model import Provider

PREFERENCE_LOSSES = ("dpo", "orpo", "simpo")
DEFAULT_BETA = {"dpo": 0.1, "orpo": 0.1, "simpo": 2.0}
"""``--beta`` when not given: TRL's defaults (DPOConfig, ORPOConfig) and SimPO's (CPOConfig's
0.1 is CPO's; the SimPO paper's beta is 2.0 to 2.5)."""
METRICS = (
    "rewards/chosen",
    "rewards/rejected",
    "rewards/accuracies",
    "rewards/margins",
    "logps/chosen",
    "logps/rejected",
)
"""What the log lines and the evaluation report, by TRL's names, each a mean over pairs."""


class PairTerms(NamedTuple):
    """One micro-batch's per-pair quantities (``[B]`` each, fp32)."""

    pair_losses: torch.Tensor
    """The loss's per-pair term (its mean is the loss, plus ORPO's NLL)."""
    chosen_logps: torch.Tensor
    rejected_logps: torch.Tensor
    chosen_rewards: torch.Tensor
    rejected_rewards: torch.Tensor
    nll_sums: torch.Tensor | None = None
    """ORPO: each chosen row's sum of token losses over its non-padding tokens."""
    nll_tokens: torch.Tensor | None = None
    """ORPO: those tokens' count per chosen row."""

    def loss(self) -> torch.Tensor:
        """The micro-batch's loss: the mean over pairs, plus ORPO's token-mean NLL."""
        loss = self.pair_losses.mean()
        if self.nll_sums is not None and self.nll_tokens is not None:
            loss = loss + self.nll_sums.sum() / self.nll_tokens.sum().clamp(min=1)
        return loss

    def metric_values(self) -> list[torch.Tensor]:
        """Each pair's value of each of :data:`METRICS` (``[B]`` each, fp32, detached)."""
        chosen, rejected = self.chosen_rewards.detach(), self.rejected_rewards.detach()
        return [
            chosen,
            rejected,
            (chosen > rejected).float(),
            chosen - rejected,
            self.chosen_logps.detach().float(),
            self.rejected_logps.detach().float(),
        ]

    def metric_sums(self) -> torch.Tensor:
        """``[pairs, *sums of METRICS]`` (float64): summed over a window, divided by its
        pairs."""
        import torch

        values = self.metric_values()
        pairs = torch.tensor(float(len(values[0])), device=values[0].device, dtype=torch.float64)
        return torch.stack([pairs, *(v.to(torch.float64).sum() for v in values)])


def model_inputs(batch: dict[str, Any]) -> dict[str, Any]:
    """What the model's forward takes from a preference batch (not its labels or example ids)."""
    return {
        "input_ids": batch["input_ids"],
        "attention_mask": batch["attention_mask"],
        "use_cache": False,
    }


def masked_loss_sums(
    choice: Choice,
    model: Any,
    unwrapped: Any,
    batch: dict[str, Any],
    targets: torch.Tensor,
    masks: list[torch.Tensor],
) -> torch.Tensor:
    """``[len(masks), 2B]``: each row's sum of token losses against ``targets`` (shifted, ``[2B,
    L]``) over each mask's tokens, from ONE forward of ``model`` (``unwrapped``: the model
    itself, whose output layer computes the losses when ``choice`` is chunked). A mask may cover
    only the first rows (ORPO's NLL: the chosen ones); the others' sums are 0. Differentiable."""
    import torch
    import torch.nn.functional as F

    rows = len(targets)

    def masked(losses: torch.Tensor) -> torch.Tensor:
        return torch.stack(
            [F.pad((losses[: len(m)] * m).sum(dim=-1), (0, rows - len(m))) for m in masks]
        )

    inputs = model_inputs(batch)
    if not choice.chunked:  # the model's logits are final: softcapped where it caps
        logits = model(**inputs).logits
        losses = losses_from_logits(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), None)
        return masked(losses.view(targets.shape))
    softcap = softcap_of(unwrapped)

    def sums(hidden: torch.Tensor, head: Any) -> torch.Tensor:
        if choice.name == "torch":
            return masked(chunked_token_losses(hidden, head.weight, head.bias, targets, softcap))
        # The kernels give one sum per call: one call per row and mask, on that row's tokens.
        zero = hidden.new_zeros((), dtype=torch.float32)
        return torch.stack(
            [
                torch.stack(
                    [
                        chunked_loss_sum(
                            choice,
                            hidden[row],
                            head.weight,
                            head.bias,
                            targets[row].masked_fill(~mask[row], IGNORE_INDEX),
                            softcap,
                        ).float()
                        if row < len(mask)
                        else zero
                        for row in range(rows)
                    ]
                )
                for mask in masks
            ]
        )

    with loss_in_output_layer(unwrapped, sums) as result:
        model(**inputs)
    return result.value


def sequence_logps(
    choice: Choice, model: Any, unwrapped: Any, batch: dict[str, Any], average: bool = False
) -> torch.Tensor:
    """``[2B]`` (fp32, chosen rows first): each row's sum of answer-token log-probs, or with
    ``average`` their mean over the answer's tokens; one forward, differentiable."""
    targets = shifted_labels(batch["labels"])
    answer = targets != IGNORE_INDEX
    logps = -masked_loss_sums(choice, model, unwrapped, batch, targets, [answer])[0]
    return logps / answer.sum(dim=-1).clamp(min=1) if average else logps


def per_sequence_choice(choice: Choice, unwrapped: Any) -> Choice:
    """``choice`` for per-sequence sums: liger computes its gradients in forward and keeps a
    gradient as large as the output weight per call until backward, and the sums take one call
    per row, so where that weight trains the torch form runs instead (it says why)."""
    head = unwrapped.get_output_embeddings() if unwrapped is not None else None
    if choice.name == "liger" and head is not None and head.weight.requires_grad:
        return Choice(
            "torch",
            "liger-kernel would keep an output-weight-sized gradient per sequence (one call per "
            "row for per-sequence sums)",
        )
    return choice


def log1mexp(x: torch.Tensor) -> torch.Tensor:
    """``log(1 - exp(x))`` for ``x < 0``, stable on both sides of ``-ln 2`` (as TRL's ORPO)."""
    import torch

    return torch.where(
        x < -0.6931471805599453, torch.log1p(-torch.exp(x)), torch.log(-torch.expm1(x))
    )


class PreferenceLoss(ChosenLoss):
    """The preference loss of ``config.preference_loss``, with the chosen implementation.

    ``model`` arguments may be wrapped (DDP); ``unwrapped`` is the model itself. DPO's
    ``reference`` (:mod:`effitrain.tasks.reference_model`) is built by :meth:`after_prepare`
    and does its work at the run's moments below."""

    token_weighted = False

    def __init__(self, config: TrainConfig, choice: Choice, unwrapped: Any):
        self.kind = config.preference_loss
        if self.kind not in PREFERENCE_LOSSES:
            raise EffitrainError(
                f"--preference-loss {self.kind} is not known; use one of "
                f"{', '.join(PREFERENCE_LOSSES)}"
            )
        self.beta = config.beta if config.beta is not None else DEFAULT_BETA[self.kind]
        self.label_smoothing = config.label_smoothing if self.kind == "dpo" else 0.0
        self.simpo_gamma = config.simpo_gamma
        self.choice = per_sequence_choice(choice, unwrapped)
        self.unwrapped = unwrapped
        self.reference: Provider | None = None
        self._window: torch.Tensor | None = None
        """Since the last log line: ``[pairs, *sums of METRICS]`` on the device."""

    def formula(self) -> str:
        """The loss in one line, with its settings."""
        if self.kind == "dpo":
            smoothing = (
                f", label smoothing {self.label_smoothing:g}" if self.label_smoothing else ""
            )
            return f"DPO (TRL's sigmoid loss, beta {self.beta:g}{smoothing}) against the reference"
        if self.kind == "orpo":
            return f"ORPO (TRL's: chosen NLL + beta {self.beta:g} x log odds ratio), no reference"
        return (
            f"SimPO (TRL's CPO simpo, beta {self.beta:g}, gamma {self.simpo_gamma:g}) on "
            "length-averaged log-probs, no reference"
        )

    def describe(self) -> list[str]:
        return [
            self.choice.describe() + (f": {self.choice.why}" if self.choice.why else ""),
            f"{self.formula()}; a mean over each micro-batch's pairs (chosen and rejected in "
            "one forward)",
        ]

    def to_dict(self) -> dict[str, Any]:
        return {
            "implementation": self.name,
            "weighting": "micro-batch mean over pairs",
            "why": self.choice.why,
            "preference_loss": self.kind,
            "beta": self.beta,
            "label_smoothing": self.label_smoothing,
            **({"simpo_gamma": self.simpo_gamma} if self.kind == "simpo" else {}),
        }

    def reference_logps(self, model: Any, unwrapped: Any, batch: dict[str, Any]) -> torch.Tensor:
        """Each sequence's summed answer log-probs, as the reference scores them."""
        return sequence_logps(self.choice, model, unwrapped, batch, average=False)

    def after_prepare(self, run: RunParts) -> None:
        """DPO: build the reference, as ``--reference`` says. The copy is made here, before any
        step or resume (the model is then as it starts); the precomputed table is allocated
        here and filled by :meth:`before_training` (or read back by :meth:`load_extra`)."""
        if self.kind == "dpo":
            from effitrain.tasks.reference_model import make_provider

            self.reference = make_provider(run, self)

    def before_training(self, run: RunParts, reporter: Reporter) -> None:
        if self.reference is not None:
            self.reference.before_training(run, reporter)

    def step_tensors(self) -> list[Any]:
        return self.reference.step_tensors() if self.reference is not None else []

    def save_extra(self, run: RunParts, folder: Path) -> None:
        if self.reference is not None:
            self.reference.save(run, folder)

    def load_extra(self, run: RunParts, folder: Path) -> None:
        if self.reference is not None:
            self.reference.load(run, folder)

    def __call__(self, model: Any, batch: dict[str, Any]) -> torch.Tensor:
        """The micro-batch's loss (fp32); its rewards join the log window (no sync)."""
        terms = self.terms(model, batch)
        sums = terms.metric_sums()
        self._window = sums if self._window is None else self._window + sums
        return terms.loss()

    def terms(self, model: Any, batch: dict[str, Any]) -> PairTerms:
        """The micro-batch's per-pair terms, from one forward of ``model`` (and, for DPO, the
        reference's log-probs)."""
        import torch
        import torch.nn.functional as F

        if self.kind == "orpo":
            return self._orpo(model, batch)
        average = self.kind == "simpo"
        logps = sequence_logps(self.choice, model, self.unwrapped, batch, average=average)
        chosen, rejected = logps.chunk(2)
        if self.kind == "simpo":
            logits = (chosen - rejected) - self.simpo_gamma / self.beta
            return PairTerms(
                -F.logsigmoid(self.beta * logits),
                chosen,
                rejected,
                self.beta * chosen.detach(),
                self.beta * rejected.detach(),
            )
        if self.reference is None:
            raise RuntimeError("DPO needs a reference: after_prepare builds it")
        with torch.no_grad():
            ref_chosen, ref_rejected = self.reference.logps(model, batch).float().chunk(2)
        chosen_ratio, rejected_ratio = chosen - ref_chosen, rejected - ref_rejected
        delta = self.beta * (chosen_ratio - rejected_ratio)
        losses = -F.logsigmoid(delta)
        if self.label_smoothing:
            e = self.label_smoothing
            losses = (1 - e) * losses - e * F.logsigmoid(-delta)
        return PairTerms(
            losses,
            chosen,
            rejected,
            self.beta * chosen_ratio.detach(),
            self.beta * rejected_ratio.detach(),
        )

    def _orpo(self, model: Any, batch: dict[str, Any]) -> PairTerms:
        """ORPO as TRL's ORPOTrainer: average answer log-probs for the odds, and the chosen
        rows' NLL over all their non-padding tokens (prompt included), from one forward."""
        import torch.nn.functional as F

        # Non-padding tokens as targets; on answer tokens they are the labels (the contract).
        every = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, IGNORE_INDEX)
        targets = shifted_labels(every)
        answer = shifted_labels(batch["labels"]) != IGNORE_INDEX
        pairs = len(targets) // 2
        nll_mask = targets[:pairs] != IGNORE_INDEX  # the chosen rows only
        sums = masked_loss_sums(
            self.choice, model, self.unwrapped, batch, targets, [answer, nll_mask]
        )
        logps = -sums[0] / answer.sum(dim=-1).clamp(min=1)
        chosen, rejected = logps.chunk(2)
        log_odds = (chosen - rejected) - (log1mexp(chosen) - log1mexp(rejected))
        return PairTerms(
            -self.beta * F.logsigmoid(log_odds),
            chosen,
            rejected,
            self.beta * chosen.detach(),
            self.beta * rejected.detach(),
            nll_sums=sums[1][:pairs],
            nll_tokens=nll_mask.sum(dim=-1),
        )

    def window_metrics(self, accelerator: Accelerator) -> dict[str, float]:
        """The rewards since the last call, averaged over the window's pairs on all processes
        (a collective under several processes, one host sync); empties the window."""
        import torch

        window = self._window
        if window is None:
            window = torch.zeros(len(METRICS) + 1, dtype=torch.float64, device=accelerator.device)
        if accelerator.num_processes > 1:
            window = accelerator.reduce(window, "sum")
        pairs, *sums = window.tolist()
        self._window = None
        if not pairs:
            return {}
        return {name: value / pairs for name, value in zip(METRICS, sums, strict=True)}


def evaluate_preference(run: RunParts) -> dict[str, Any]:
    """Validation loss and rewards over every pair, each counted once on all processes: the
    loss as training computes it over the whole set (the mean over pairs, plus ORPO's token-mean
    NLL), and the rewards' means by TRL's names (``rewards/accuracies`` above all)."""
    import torch

    model, accelerator, loss = run.model, run.accelerator, run.loss
    assert isinstance(loss, PreferenceLoss)  # the preference task's
    gathered: list[torch.Tensor] = []
    with torch.no_grad():
        for batch in run.eval_loader:
            terms = loss.terms(model, batch)
            zeros = torch.zeros_like(terms.pair_losses, dtype=torch.float32)
            nll_sums = zeros if terms.nll_sums is None else terms.nll_sums.float()
            nll_tokens = zeros if terms.nll_tokens is None else terms.nll_tokens.float()
            columns = torch.stack(
                [terms.pair_losses.float(), nll_sums, nll_tokens, *terms.metric_values()], dim=-1
            )
            gathered.append(accelerator.gather_for_metrics(columns).double().cpu())
    table = torch.cat(gathered) if gathered else torch.zeros(0, 9, dtype=torch.float64)
    pairs = len(table)
    means = table.mean(dim=0) if pairs else torch.zeros(9, dtype=torch.float64)
    nll = float(table[:, 1].sum() / table[:, 2].sum().clamp(min=1)) if pairs else 0.0
    metrics: dict[str, Any] = {"loss": float(means[0]) + nll, "pairs": pairs}
    metrics.update({name: float(means[3 + i]) for i, name in enumerate(METRICS)})
    return metrics
