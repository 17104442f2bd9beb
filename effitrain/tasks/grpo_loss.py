"""GRPO's step as TRL 1.16's ``GRPOTrainer`` takes it: generate a group of G completions per
prompt, score them, normalise the rewards within each group, and train on the clipped
policy-gradient loss of the completion tokens.

**Generation** (:meth:`GrpoLoss.step_batches`, before the optimizer step's first forward, as TRL
generates a whole step's completions at once): transformers' ``generate`` on the unwrapped model
(adapters on, the policy's dtype, KV cache on, no gradient, in eval mode so that neither dropout
nor gradient checkpointing acts), prompts left-padded, sampled with ``--temperature`` and
``--top-p`` (top-k off, as TRL's). Each micro-batch is sampled from its own seed, drawn from
(``--seed``, the generation's number, the micro-batch's place among the step's on all
processes), so a resumed run draws what the uninterrupted one drew, and N processes draw what
one process draws from the same global batch; the global RNG is left as it was. A completion
ends at its first eos, which it keeps. The step's completions serve ``--num-iterations`` N
optimizer steps (TRL's ``num_iterations``); a checkpoint between them keeps them.

**Advantages** (:func:`group_advantages`): the rewards' weighted ``nansum`` over functions (NaN
where every function returned None: no advantage), minus the group's mean, over the group's std
(``--scale-rewards group``), the whole step's (``batch``) or not divided (``none``), + 1e-4.

**Loss** (:func:`policy_loss`): with one iteration per generation the old log-probs are the
current ones, detached, so the ratio is 1 and its gradient that of the log-probs; with N > 1
they are the policy's at generation (a forward without gradient, as TRL's), so the ratio
moves away from 1 as the N steps go and the clip bites;
``-min(ratio * A, clip(ratio, 1 - eps, 1 + eps_high) * A)`` per token, reduced as TRL's
``loss_type``: ``grpo`` a mean of sequence means, ``bnpo`` the micro-batch's token mean, ``dr_grpo``
the sum over completions x max completion length, ``dapo`` (TRL's default) a token mean over
the optimizer step on all processes (the loop's token weighting: ``token_weighted``). The
log-probs are of the logits over ``--temperature``, for the completion tokens only.

**KL to the reference** (``--beta`` > 0, :func:`per_token_kl`): TRL's k3 estimator
``exp(ref - logp) - (ref - logp) - 1`` per completion token, ``beta`` times it added to the
per-token loss before the reduction; the reference's log-probs (the same forward, no grad, in
eval mode) come from the ``--reference`` lever's provider
(:mod:`effitrain.tasks.reference_model`: the adapters switched off, or a frozen copy of the
model as it starts), built by :meth:`GrpoLoss.after_prepare` and run in the step, before the
policy's forward.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

from effitrain.errors import EffitrainError
from effitrain.tasks.base import LossMoments
from effitrain.tasks.grpo_data import encode_prompts
from effitrain.tasks.grpo_rewards import RewardFunction, score
from effitrain.tasks.lm_data import IGNORE_INDEX

if TYPE_CHECKING:
    from collections.abc import Callable
    from contextlib import AbstractContextManager
    from pathlib import Path

    import torch
    from accelerate import Accelerator

    from effitrain.config import TrainConfig
    from effitrain.parts import RunParts
    from effitrain.tasks.reference_model import Provider

COMPLETION_LENGTH, DEMO_COMPLETION_LENGTH = 512, 16
"""``--max-completion-length`` when not given: TRL's default; the built-in demo's."""
STATE_FILE = "grpo_state.json"
"""What a checkpoint keeps of GRPO's own: the reward history, and how many of
``--num-iterations`` steps the last generation has served."""
BUFFER_FILE = "grpo_buffer.rank{rank}.safetensors"
"""Each process's generated micro-batches, where a checkpoint falls between their N steps."""
ADVANTAGE_EPS = 1e-4
"""What TRL adds to the std that divides the advantages."""


def completion_length(config: TrainConfig) -> int:
    """The most tokens a completion runs to: ``--max-completion-length``, else its default."""
    return config.max_completion_length or (
        DEMO_COMPLETION_LENGTH if config.uses_builtin_data else COMPLETION_LENGTH
    )


@dataclass(frozen=True)
class GrpoSettings:
    """GRPO's options, resolved once."""

    num_generations: int
    max_completion_length: int
    temperature: float
    top_p: float
    loss_type: str
    scale_rewards: str
    epsilon_low: float
    epsilon_high: float
    weights: tuple[float, ...]
    """One per reward function."""
    beta: float = 0.0
    """The KL penalty's coefficient (0: no reference)."""
    num_iterations: int = 1
    """Optimizer steps on each generation's completions (TRL's ``num_iterations``)."""

    @classmethod
    def of(cls, config: TrainConfig, weights: list[float]) -> GrpoSettings:
        return cls(
            config.num_generations,
            completion_length(config),
            config.temperature,
            config.top_p,
            config.grpo_loss,
            config.scale_rewards,
            config.epsilon,
            config.epsilon if config.epsilon_high is None else config.epsilon_high,
            tuple(weights),
            beta=config.beta or 0.0,
            num_iterations=config.num_iterations,
        )


def nanstd(values: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """The std ignoring NaNs, Bessel-corrected (NaN below two values), as TRL's ``nanstd``."""
    import torch

    mean = torch.nanmean(values, dim=dim, keepdim=True)
    variance = torch.nanmean((values - mean) ** 2, dim=dim, keepdim=True)
    count = torch.sum(~torch.isnan(values), dim=dim, keepdim=True)
    correction = torch.where(count > 1, count / (count - 1), torch.full_like(mean, math.nan))
    std = torch.sqrt(variance * correction)
    return std.squeeze() if dim is None else std.squeeze(dim)


def weighted_rewards(per_function: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Each completion's reward: the weighted ``nansum`` over functions, NaN where every
    function returned None (unscorable)."""
    import torch

    rewards = (per_function * weights.unsqueeze(0)).nansum(dim=1)
    return torch.where(torch.isnan(per_function).all(dim=1), math.nan, rewards)


def function_means(rewards: list[RewardFunction], per_function: torch.Tensor) -> dict[str, float]:
    """Each reward function's mean over the completions (``[N, functions]``), None's left
    out, by TRL's name ``rewards/<name>/mean``."""
    import torch

    return {
        f"rewards/{reward.name}/mean": float(torch.nanmean(per_function[:, column]))
        for column, reward in enumerate(rewards)
    }


def group_advantages(
    per_function: torch.Tensor, weights: torch.Tensor, group: int, scale: str
) -> torch.Tensor:
    """Each completion's advantage (``[N]``) from the rewards of ``N`` completions in groups
    of ``group`` consecutive ones (``[N, functions]``), as TRL's ``sum_then_normalize``."""
    import torch

    rewards = weighted_rewards(per_function, weights)
    grouped = rewards.view(-1, group)
    mean = torch.nanmean(grouped, dim=1).repeat_interleave(group)
    if scale == "batch":
        std = nanstd(rewards).expand_as(rewards) if rewards.numel() > 1 else rewards * 0
    else:  # "group", and "none" (whose std TRL only logs)
        std = nanstd(grouped, dim=1).repeat_interleave(group) if group > 1 else rewards * 0
    advantages = rewards - mean
    if scale != "none":
        advantages = advantages / (std + ADVANTAGE_EPS)
    return torch.nan_to_num(advantages, nan=0.0)


def completion_logps(
    model: torch.nn.Module, batch: dict[str, Any], temperature: float
) -> torch.Tensor:
    """Each completion token's log-prob (``[B, T]``, fp32) under the logits over
    ``temperature``, from one forward that keeps only the completion's logits."""
    import torch

    width = batch["completion_ids"].shape[1]
    logits = model(
        input_ids=batch["input_ids"],
        attention_mask=batch["attention_mask"],
        logits_to_keep=width + 1,
        use_cache=False,
    ).logits[:, :-1]
    logps = torch.log_softmax(logits.float() / temperature, dim=-1)
    return logps.gather(-1, batch["completion_ids"].unsqueeze(-1)).squeeze(-1)


def per_token_kl(logps: torch.Tensor, ref_logps: torch.Tensor) -> torch.Tensor:
    """Each token's KL to the reference as TRL estimates it (k3, non-negative):
    ``exp(ref - logp) - (ref - logp) - 1``."""
    import torch

    return torch.exp(ref_logps - logps) - (ref_logps - logps) - 1


class PolicyLoss(NamedTuple):
    loss: torch.Tensor
    low: torch.Tensor
    """The tokens whose ratio was clipped below (``[B, T]``, bool): under 1 - eps, A < 0."""
    high: torch.Tensor
    """The tokens whose ratio was clipped above: over 1 + eps_high, A > 0."""


def policy_loss(
    logps: torch.Tensor,
    old_logps: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    settings: GrpoSettings,
    kl: torch.Tensor | None = None,
) -> PolicyLoss:
    """The micro-batch's loss as TRL's ``_compute_loss`` (before its division by the
    accumulation steps, which the loop's backward makes; ``dapo``: the sum, which the loop
    weighs by the step's tokens), and its tokens whose ratio was clipped, as TRL counts them.
    ``kl`` (``[B, T]``, :func:`per_token_kl`): ``settings.beta`` times it joins each token's
    loss before the reduction."""
    import torch

    advantages = advantages.unsqueeze(1)
    ratio = torch.exp(logps - old_logps)
    clipped_ratio = torch.clamp(ratio, 1 - settings.epsilon_low, 1 + settings.epsilon_high)
    per_token = -torch.min(ratio * advantages, clipped_ratio * advantages)
    if kl is not None:
        per_token = per_token + settings.beta * kl
    mask = mask.to(per_token.dtype)
    if settings.loss_type == "grpo":
        loss = ((per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
    elif settings.loss_type == "bnpo":
        loss = (per_token * mask).sum() / mask.sum().clamp(min=1.0)
    elif settings.loss_type == "dr_grpo":
        loss = (per_token * mask).sum() / (per_token.size(0) * settings.max_completion_length)
    else:  # dapo
        loss = (per_token * mask).sum()
    low = (ratio < 1 - settings.epsilon_low) & (advantages < 0)
    high = (ratio > 1 + settings.epsilon_high) & (advantages > 0)
    return PolicyLoss(loss, low & mask.bool(), high & mask.bool())


class GrpoLoss(LossMoments):
    """GRPO's loss, with the generation and scoring that feed it, and TRL's metrics. With
    ``--beta`` > 0, ``reference`` (:mod:`effitrain.tasks.reference_model`) is built by
    :meth:`after_prepare`."""

    name = "grpo"
    chunked = False
    generates = True

    def __init__(self, settings: GrpoSettings, rewards: list[RewardFunction], seed: int):
        self.settings = settings
        self.rewards = rewards
        self.seed = seed
        self.reward_history: list[float] = []
        """The mean reward of each generation's completions, in order."""
        self._window: list[dict[str, float]] = []
        self._clip: torch.Tensor | None = None
        """The window's completion tokens clipped low, high, either, and all (on the device)."""
        self.reference: Provider | None = None
        self._kl: list[torch.Tensor] = []
        """Each micro-batch's (KL sum over its completion tokens, their count), on the device."""
        self._buffer: list[dict[str, Any]] | None = None
        """The last generation's micro-batches, while they serve their N steps."""
        self._uses = 0
        """How many optimizer steps ``_buffer`` has served."""

    @property
    def token_weighted(self) -> bool:
        return self.settings.loss_type == "dapo"

    def __call__(self, model: torch.nn.Module, batch: dict[str, Any]) -> torch.Tensor:
        import torch

        mask = batch["completion_mask"]
        # The reference's forward first: what it holds is freed before the policy's forward.
        ref_logps = self.reference.logps(model, batch) if self.reference is not None else None
        logps = completion_logps(model, batch, self.settings.temperature)
        kl = None if ref_logps is None else per_token_kl(logps, ref_logps)
        if kl is not None:  # summed on the device: no sync
            self._kl.append(torch.stack([(kl.detach() * mask).sum(), mask.sum().float()]))
        old = batch.get("old_logps", logps.detach())  # absent: one iteration, the ratio is 1
        terms = policy_loss(logps, old, batch["advantages"], mask, self.settings, kl)
        clipped = [terms.low.sum(), terms.high.sum(), (terms.low | terms.high).sum(), mask.sum()]
        counts = torch.stack(clipped).float()  # summed on the device: no sync
        self._clip = counts if self._clip is None else self._clip + counts
        return terms.loss

    def reference_logps(self, model: Any, unwrapped: Any, batch: dict[str, Any]) -> torch.Tensor:
        """Each completion token's log-prob, as the reference scores it (its provider calls
        this under no grad, in eval mode)."""
        return completion_logps(model, batch, self.settings.temperature)

    def after_prepare(self, run: RunParts) -> None:
        """``--beta`` > 0: build the reference, as ``--reference`` says; a copy is made here,
        before any step or resume (the model as it starts)."""
        if self.settings.beta:
            from effitrain.tasks.reference_model import make_provider

            self.reference = make_provider(run, self)

    def step_tensors(self) -> list[Any]:
        return self.reference.step_tensors() if self.reference is not None else []

    def step_batches(
        self,
        run: RunParts,
        batches: list[dict[str, Any]],
        generating: Callable[[], AbstractContextManager[None]],
    ) -> Iterator[list[dict[str, Any]]]:
        """The batches' completions, generated (inside ``generating``) and scored, for each of
        ``--num-iterations`` optimizer steps, as TRL's buffered inputs (after a resume between
        those steps: the ones the checkpoint kept, for the steps left)."""
        if self._buffer is None:
            with generating():
                self._buffer, self._uses = self._generate_step(run, batches), 0
        while self._uses < self.settings.num_iterations:
            self._uses += 1  # before the step: a checkpoint after it counts it
            yield self._buffer
        self._buffer = None

    def _generate_step(self, run: RunParts, batches: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Generate each batch's completions and score them; the advantages are normalised
        over the groups of every process (a gather), as TRL's. With N > 1 iterations, the old
        log-probs too, as TRL computes them: the policy's now, without gradient."""
        import torch

        step, rank = len(self.reward_history), run.accelerator.process_index
        seeds = [self.generation_seed(run, step, index) for index in range(len(batches))]
        if "rows" not in batches[0]:  # the estimate's prompts, fake token ids: nothing to score
            made = [self._estimated(run, b, s) for b, s in zip(batches, seeds, strict=True)]
            self._old_logps(run, made)
            return made
        made = [self._generate(run, b["rows"], s) for b, s in zip(batches, seeds, strict=True)]
        per_function = torch.cat([m.pop("rewards_per_function") for m in made])
        lengths = torch.cat([m["completion_mask"].sum(1).cpu() for m in made]).float()
        device = run.accelerator.device
        gathered = run.accelerator.gather(per_function.to(device)).cpu()
        gathered_lengths = run.accelerator.gather(lengths.to(device)).cpu()
        weights = torch.tensor(self.settings.weights)
        advantages = group_advantages(
            gathered, weights, self.settings.num_generations, self.settings.scale_rewards
        )
        local = advantages[rank * len(per_function) : (rank + 1) * len(per_function)]
        for m, part in zip(made, local.split([len(m["input_ids"]) for m in made]), strict=True):
            m["advantages"] = part.to(device)
        self._old_logps(run, made)
        self._record(gathered, weights, gathered_lengths)
        return made

    def _generate(self, run: RunParts, rows: list[dict[str, Any]], seed: int) -> dict[str, Any]:
        """One micro-batch: G completions of each prompt in ``rows``, sampled from ``seed``,
        scored."""
        made = generate(run, rows, self.settings, seed)
        repeated = [row for row in rows for _ in range(self.settings.num_generations)]
        made.batch["rewards_per_function"] = score(
            self.rewards, repeated, [r["prompt"] for r in repeated], made.texts, made.ids
        )
        return made.batch

    def _estimated(self, run: RunParts, batch: dict[str, Any], seed: int) -> dict[str, Any]:
        """One micro-batch of ``effitrain estimate``: G completions of each prompt its batch
        holds (fake token ids, as the tokenizer gives them), sampled by the run's own
        :func:`sample`, to full length; no text to score, so advantages of zero."""
        import torch

        made = sample(
            run,
            batch["input_ids"],
            batch["attention_mask"],
            self.settings,
            seed,
            self.settings.num_generations,
        )
        made["advantages"] = torch.zeros(len(made["input_ids"]), device=run.accelerator.device)
        return made

    def _old_logps(self, run: RunParts, made: list[dict[str, Any]]) -> None:
        """With N > 1 iterations, each micro-batch's old log-probs, as TRL computes them: the
        policy's as it generated, without gradient, in training mode."""
        import torch

        if self.settings.num_iterations > 1:
            with torch.no_grad():
                for m in made:
                    m["old_logps"] = completion_logps(run.model, m, self.settings.temperature)

    def generation_seed(self, run: RunParts, step: int, index: int) -> int:
        """The seed of this process's ``index``-th micro-batch of the ``step``-th generation (-1:
        the evaluation's, the same at every evaluation), drawn from its place among all
        processes' micro-batches: Accelerate deals the loader's batches out in turn, so this
        process's i-th is the global i x processes + rank, and N processes draw what one does."""
        place = index * run.accelerator.num_processes + run.accelerator.process_index
        return (self.seed * 1_000_003 + step) * 10_007 * 10_007 + place

    def _record(self, per_function: torch.Tensor, weights: torch.Tensor, lengths: Any) -> None:
        """The step's metrics, by TRL's names, and its mean reward into the history."""
        import torch

        rewards = weighted_rewards(per_function, weights)
        metrics = {
            "reward": float(torch.nanmean(rewards)),
            "reward_std": float(nanstd(rewards)),
            "completions/mean_length": float(lengths.mean()),
            **function_means(self.rewards, per_function),
        }
        self._window.append(metrics)
        self.reward_history.append(metrics["reward"])

    def window_metrics(self, accelerator: Accelerator) -> dict[str, float]:
        """The means of the generations' metrics since the last log line (every process has
        the gathered rewards already), ``kl``, and the shares of the completion tokens whose
        ratio was clipped, by TRL's names: of the window's tokens on all processes (one
        all-reduce), so that N processes log what one does (TRL averages each micro-batch's
        share: the same where a log line has one micro-batch)."""
        metrics: dict[str, float] = {}
        if self._window:
            names = list(self._window[0])
            metrics = {n: sum(m[n] for m in self._window) / len(self._window) for n in names}
        if self._kl:
            metrics["kl"] = self._kl_mean(accelerator)
        if self._clip is not None:
            counts = self._clip
            if accelerator.num_processes > 1:
                counts = accelerator.reduce(counts, "sum")
            shares = (counts[:3] / counts[3].clamp(min=1.0)).tolist()
            for name, share in zip(("low", "high", "region"), shares, strict=True):
                metrics[f"clip_ratio/{name}_mean"] = share
        self._window, self._clip, self._kl = [], None, []
        return metrics

    def _kl_mean(self, accelerator: Accelerator) -> float:
        """TRL's ``kl``: each micro-batch's token mean over all processes (one reduce for the
        window), averaged over the window's micro-batches."""
        import torch

        sums = torch.stack(self._kl)
        if accelerator.num_processes > 1:
            sums = accelerator.reduce(sums, "sum")
        return float((sums[:, 0] / sums[:, 1].clamp(min=1.0)).mean())

    def describe(self) -> list[str]:
        s = self.settings
        names = ", ".join(f"{r.name} x{w:g}" for r, w in zip(self.rewards, s.weights, strict=True))
        kl = f"; KL to the reference x beta {s.beta:g}" if s.beta else ""
        reused = f", each trained on for {s.num_iterations} steps" if s.num_iterations > 1 else ""
        return [
            f"GRPO ({s.loss_type} loss): {s.num_generations} completions per prompt{reused}, up "
            f"to {s.max_completion_length} tokens, temperature {s.temperature:g}, top-p "
            f"{s.top_p:g}; rewards: {names}{kl}"
        ]

    def to_dict(self) -> dict[str, Any]:
        s = self.settings
        return {
            "implementation": self.name,
            "weighting": "step token mean" if self.token_weighted else "micro-batch",
            "loss_type": s.loss_type,
            "beta": s.beta,
            "num_generations": s.num_generations,
            "max_completion_length": s.max_completion_length,
            "num_iterations": s.num_iterations,
            "rewards": [r.source for r in self.rewards],
            "reward_weights": list(s.weights),
        }

    def histories(self) -> dict[str, list[float]]:
        return {"reward_history": list(self.reward_history)}

    def save_extra(self, run: RunParts, folder: Path) -> None:
        """The reward history; between the N steps of one generation, its completions too (each
        process its own): the weights have moved since, so they could not be made again."""
        from safetensors.torch import save_file

        uses = self._uses if self._buffer is not None else 0
        if uses >= self.settings.num_iterations:
            uses = 0  # served: the next step generates
        if run.accelerator.is_main_process:
            state = {
                "reward_history": self.reward_history,
                "buffer_uses": uses,
                "processes": run.accelerator.num_processes,
            }
            (folder / STATE_FILE).write_text(json.dumps(state))
        if uses and self._buffer is not None:
            tensors = {
                f"{index}.{key}": value.detach().cpu().contiguous()
                for index, batch in enumerate(self._buffer)
                for key, value in batch.items()
            }
            save_file(tensors, str(folder / BUFFER_FILE.format(rank=run.accelerator.process_index)))

    def load_extra(self, run: RunParts, folder: Path) -> None:
        """Read back what :meth:`save_extra` wrote.

        Raises:
            EffitrainError: the checkpoint falls between the N steps of a generation, and was
                saved by another number of processes (each kept its own completions) or this
                process's file is missing.
        """
        from safetensors.torch import load_file

        state = json.loads((folder / STATE_FILE).read_text())
        self.reward_history = [float(r) for r in state["reward_history"]]
        uses = int(state.get("buffer_uses", 0))
        self._buffer, self._uses = None, 0
        if not 0 < uses < self.settings.num_iterations:
            return
        path = folder / BUFFER_FILE.format(rank=run.accelerator.process_index)
        saved = state.get("processes", 1)
        if saved != run.accelerator.num_processes or not path.exists():
            raise EffitrainError(
                f"cannot resume from {folder}: it was saved {uses} of --num-iterations "
                f"{self.settings.num_iterations} steps into a generation, whose completions its "
                f"{saved} process(es) kept ({path.name} for this one); resume it with "
                f"{saved} process(es), or resume a checkpoint whose step is a multiple of "
                f"{self.settings.num_iterations}"
            )
        tensors = load_file(str(path), device=str(run.accelerator.device))
        buffer: dict[int, dict[str, Any]] = {}
        for name, value in tensors.items():
            index, key = name.split(".", 1)
            buffer.setdefault(int(index), {})[key] = value
        self._buffer, self._uses = [buffer[i] for i in sorted(buffer)], uses


class Generated(NamedTuple):
    batch: dict[str, Any]
    """Prompt + completion rows: ``input_ids``, ``attention_mask``, ``labels`` (the
    completions'), ``completion_ids`` and ``completion_mask``."""
    texts: list[str]
    """Each completion decoded, special tokens left out."""
    ids: list[list[int]]
    """Each completion's token ids (up to its eos, kept)."""


def generate(
    run: RunParts,
    rows: list[dict[str, Any]],
    settings: GrpoSettings,
    seed: int,
    group: int | None = None,
) -> Generated:
    """``group`` (default G) completions of each prompt in ``rows``, tokenized (left-padded)
    and sampled by :func:`sample`, and decoded."""
    tokenizer = run.tokenizer
    assert tokenizer is not None  # a run's: an estimate samples from its prompts' token ids
    prompts = [row["prompt"] for row in rows]
    encoded = encode_prompts(
        prompts, tokenizer, return_tensors="pt", padding=True, padding_side="left"
    ).to(run.accelerator.device)
    batch = sample(
        run,
        encoded["input_ids"],
        encoded["attention_mask"],
        settings,
        seed,
        group or settings.num_generations,
    )
    lengths = batch["completion_mask"].sum(1).tolist()
    ids = [row[:n] for row, n in zip(batch["completion_ids"].tolist(), lengths, strict=True)]
    return Generated(batch, tokenizer.batch_decode(ids, skip_special_tokens=True), ids)


def sample(
    run: RunParts,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    settings: GrpoSettings,
    seed: int,
    group: int,
) -> dict[str, Any]:
    """``group`` completions of each prompt (``prompt_ids``, left-padded), sampled from
    ``seed`` on the unwrapped model in eval mode, as the training batch (prompt + completion
    rows: ``input_ids``, ``attention_mask``, ``labels`` (the completions'), ``completion_ids``
    and ``completion_mask``); the global RNG is left as it was.

    On fake tensors (``effitrain estimate``), the worst case: no value says where an eos was
    sampled, so every completion runs to ``--max-completion-length``
    (:func:`_first_and_last_steps`)."""
    import torch
    from torch._subclasses.fake_tensor import is_fake

    fake = is_fake(prompt_ids)
    model = run.accelerator.unwrap_model(run.model)
    eos, pad = _special_ids(run.tokenizer, model)
    prompt_ids = prompt_ids.repeat_interleave(group, dim=0)
    prompt_mask = prompt_mask.repeat_interleave(group, dim=0)
    was_training = model.training
    model.eval()  # no dropout, no gradient checkpointing: the KV cache stays on
    device = prompt_ids.device
    devices = [device.index or 0] if device.type == "cuda" else []
    options = {
        "use_cache": True,  # off for training (effitrain.models), on for generating
        "pad_token_id": pad,
        "eos_token_id": eos,
        "do_sample": True,
        "temperature": settings.temperature,
        "top_p": settings.top_p,
        "top_k": 0,  # off, as TRL's
    }
    with torch.random.fork_rng(devices=devices), torch.no_grad():
        torch.manual_seed(seed)
        if fake:
            output = _first_and_last_steps(
                model, prompt_ids, prompt_mask, settings.max_completion_length, options
            )
        else:
            output = model.generate(
                input_ids=prompt_ids,
                attention_mask=prompt_mask,
                max_new_tokens=settings.max_completion_length,
                **options,
            )
    model.train(was_training)
    generated = output[:, prompt_ids.shape[1] :]
    if fake:
        completion_ids, completion_mask = generated, torch.ones_like(generated)
    else:
        assert eos is not None and pad is not None  # a run's tokenizer has both
        completion_ids, completion_mask = _completions(generated, eos, pad)
    labels = completion_ids.masked_fill(completion_mask == 0, IGNORE_INDEX)
    return {
        "input_ids": torch.cat([prompt_ids, completion_ids], dim=1),
        "attention_mask": torch.cat([prompt_mask, completion_mask], dim=1),
        "labels": torch.cat([torch.full_like(prompt_ids, IGNORE_INDEX), labels], dim=1),
        "completion_ids": completion_ids,
        "completion_mask": completion_mask,
    }


def _special_ids(tokenizer: Any, model: torch.nn.Module) -> tuple[int | None, int | None]:
    """The eos and pad ids generation uses: the tokenizer's (one without a pad token pads
    with its eos, as the task sets it up), or, for an estimate of a model known by its config
    alone, the config's."""
    if tokenizer is not None:
        eos = tokenizer.eos_token_id
        return eos, eos if tokenizer.pad_token_id is None else tokenizer.pad_token_id
    config = getattr(model, "config", None)
    eos = getattr(config, "eos_token_id", None)
    eos = eos[0] if isinstance(eos, list) else eos
    pad = getattr(config, "pad_token_id", None)
    return eos, eos if pad is None else pad


STEPS_RUN_WHOLE = 4
"""Up to this many new tokens, an estimate generates every one; past it, the first and the
last steps (:func:`_first_and_last_steps`)."""


def _first_and_last_steps(
    model: Any,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    new_tokens: int,
    options: dict[str, Any],
) -> torch.Tensor:
    """``generate``'s worst case on fake tensors: every completion ``new_tokens`` long. Its
    decode steps are alike, each holding a longer KV cache than the one before, so the phase's
    peak is in its first forward (the prompts') or its last: both are run by ``generate``
    itself, the last from a cache grown to its length then (the prompts' cache, each layer's
    keys and values as long as the last step finds them), with the step before it, whose
    logits and sampling tensors are still alive in the last. Returns prompt + completion ids.
    A cache other than transformers' plain dynamic one (sliding windows) is generated whole."""
    import torch
    from transformers.cache_utils import DynamicLayer

    def generate(ids: torch.Tensor, mask: torch.Tensor, tokens: int, **more: Any) -> Any:
        with _to_the_end(tokens):
            return model.generate(
                input_ids=ids, attention_mask=mask, max_new_tokens=tokens, **options, **more
            )

    if new_tokens <= STEPS_RUN_WHOLE:
        return generate(prompt_ids, prompt_mask, new_tokens)
    first = generate(prompt_ids, prompt_mask, 1, return_dict_in_generate=True)
    name = "cache" if "cache" in first else "past_key_values"  # transformers 5.x renamed it
    cache = first[name]
    del first
    if any(type(layer) is not DynamicLayer for layer in getattr(cache, "layers", [None])):
        return generate(prompt_ids, prompt_mask, new_tokens)
    rows, length = prompt_ids.shape[0], prompt_ids.shape[1] + new_tokens
    for layer in cache.layers:  # as long as the step before the last finds it
        shape = (*layer.keys.shape[:2], length - 3, layer.keys.shape[3])
        layer.keys = layer.keys.new_empty(shape)
        layer.values = layer.values.new_empty(shape)
    ids = prompt_ids.new_zeros(rows, length - 2)
    return generate(ids, torch.ones_like(ids), 2, **{name: cache})


@contextmanager
def _to_the_end(new_tokens: int) -> Iterator[None]:
    """transformers' ``generate`` stops after exactly ``new_tokens`` tokens: on fake tensors
    its check for unfinished sequences (a value read back, which a fake tensor has not) would
    stop it at the first; here the check answers by count alone, once per token."""
    from unittest import mock

    from transformers.generation.utils import GenerationMixin

    left = [new_tokens]

    def unfinished(*_args: Any, **_kwargs: Any) -> bool:
        left[0] -= 1
        return left[0] >= 0

    with mock.patch.object(GenerationMixin, "_has_unfinished_sequences", unfinished):
        yield
    if left[0] != -1:
        raise EffitrainError(
            "cannot estimate GRPO's generation with this transformers version: its generate() "
            f"did not run {new_tokens} steps"
        )


def evaluate_grpo(run: RunParts) -> dict[str, Any]:
    """One sampled completion of each validation prompt, scored: the mean reward, each
    function's, the mean length, and the first prompt's completion under ``"sample"``, its
    reward (the weighted sum) under ``"sample_reward"``. The
    sampling is seeded alike at every evaluation (greedy decoding would show one token repeated
    long before the policy prefers it)."""
    import torch

    loss = run.loss
    assert isinstance(loss, GrpoLoss)  # the task's
    scored: list[torch.Tensor] = []
    lengths: list[int] = []
    sample = ""
    for index, batch in enumerate(run.eval_loader):
        rows = batch["rows"]
        made = generate(run, rows, loss.settings, loss.generation_seed(run, -1, index), group=1)
        prompts = [row["prompt"] for row in rows]
        scored.append(score(loss.rewards, rows, prompts, made.texts, made.ids))
        lengths.extend(len(ids) for ids in made.ids)
        if not sample:  # a chat's last turn stands for it
            first = prompts[0] if isinstance(prompts[0], str) else prompts[0][-1]["content"]
            sample = f"{first} -> {made.texts[0]}"
    device = run.accelerator.device
    per_function = run.accelerator.gather_for_metrics(torch.cat(scored).to(device)).cpu()
    counts = run.accelerator.gather_for_metrics(torch.tensor(lengths, device=device)).cpu()
    weights = torch.tensor(loss.settings.weights)
    rewards = weighted_rewards(per_function, weights)
    first = weighted_rewards(scored[0][:1], weights) if scored else torch.tensor([math.nan])
    return {
        "reward": float(torch.nanmean(rewards)),
        "completions/mean_length": float(counts.float().mean()),
        "examples": len(rewards),
        **function_means(loss.rewards, per_function),
        "sample": sample,
        "sample_reward": float(first[0]),
    }


def _completions(generated: torch.Tensor, eos: int, pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The completions cut after their first eos (kept), padded with ``pad`` to the longest
    one, and their mask, as TRL's."""
    import torch

    is_eos = generated == eos
    ends = torch.where(is_eos.any(dim=1), is_eos.int().argmax(dim=1), generated.shape[1])
    positions = torch.arange(generated.shape[1], device=generated.device)
    mask = (positions.unsqueeze(0) <= ends.unsqueeze(1)).long()
    width = max(int(mask.sum(1).max()), 1)
    return generated.masked_fill(mask == 0, pad)[:, :width], mask[:, :width]
