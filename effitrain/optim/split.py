"""Optimizers that treat the transformer body's 2-D hidden matrices differently: Muon, GaLore,
APOLLO (``--optim muon|galore|apollo``).

All three follow their authors: the special update (Muon's orthogonalised momentum, GaLore's and
APOLLO's low-rank projected gradient) is for the hidden matrices only; embeddings, the
classification head and every 1-D parameter (biases, LayerNorm) keep AdamW.

:func:`hidden_matrices` makes that split, one rule for every architecture effitrain loads:

- the *body* is the transformers model's base model (``model.<base_model_prefix>``:
  ``distilbert``, ``bert``, ``mpnet``…) without its ``pooler`` (BERT's/MiniLM's pooler feeds the
  head only, and :func:`effitrain.models.head_modules` counts it as head);
- hidden = trainable parameters with ``ndim == 2`` inside the body that are not the weight of an
  ``nn.Embedding`` (word, position, token-type embeddings; MPNet's relative attention bias);
- everything else (the head: ``pre_classifier``/``classifier``, BERT's pooler; embeddings; 1-D
  parameters) is "other".

With LoRA on (``--lora-rank``) the base weights are frozen, so the hidden matrices are the
adapters' ``lora_A``/``lora_B`` inside the body, and the trained head copies (peft's
``modules_to_save``) are "other". Muon runs on them; GaLore and APOLLO refuse (the adapters are
already low rank: projecting their gradients saves nothing).

Each parameter keeps its group's weight decay. :class:`SplitOptimizer` joins two optimizers
(Muon + AdamW) into one that Accelerate, the lr scheduler, checkpoints and the ledger see as a
single optimizer. :func:`keep_projectors_in_state_dict` lets GaLore's and APOLLO's projector
objects (a Python object per matrix, holding the projection matrix) travel through
``state_dict()``/``load_state_dict`` as plain dicts, so checkpoints are loadable with
``weights_only=True`` and resume is exact.

Imports torch at module level: only imported from the registry's factories.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

from effitrain.errors import EffitrainError

ParamGroups = list[dict[str, Any]]


def _hf_model(model: torch.nn.Module) -> torch.nn.Module:
    from effitrain.models import base_model

    return base_model(model)


def hidden_parameter_ids(model: torch.nn.Module) -> set[int]:
    """ids of the trainable 2-D hidden matrices of ``model`` (see the module's rule)."""
    hf = _hf_model(model)
    prefix = getattr(hf, "base_model_prefix", "")
    body = getattr(hf, prefix, None) if prefix else None
    if not isinstance(body, torch.nn.Module):
        raise EffitrainError(
            f"cannot find the transformer body of {type(hf).__name__} (no base model "
            f"'{prefix}'): Muon, GaLore and APOLLO need it to tell hidden matrices from the head"
        )
    excluded: set[int] = set()
    pooler = getattr(body, "pooler", None)
    if isinstance(pooler, torch.nn.Module):
        excluded.update(id(p) for p in pooler.parameters())
    for module in body.modules():
        if isinstance(module, torch.nn.Embedding):
            excluded.add(id(module.weight))
    return {
        id(p)
        for p in body.parameters()
        if p.requires_grad and p.ndim == 2 and id(p) not in excluded
    }


def hidden_matrices(model: torch.nn.Module, groups: ParamGroups) -> tuple[ParamGroups, ParamGroups]:
    """Split ``groups`` (``optim.param_groups``) into (hidden groups, other groups).

    Each returned group keeps its source group's options (weight decay); empty groups are
    dropped. Every parameter of ``groups`` lands in exactly one of the two.
    """
    hidden_ids = hidden_parameter_ids(model)
    hidden: ParamGroups = []
    other: ParamGroups = []
    for group in groups:
        options = {k: v for k, v in group.items() if k != "params"}
        params = list(group["params"])
        inside = [p for p in params if id(p) in hidden_ids]
        outside = [p for p in params if id(p) not in hidden_ids]
        if inside:
            hidden.append({**options, "params": inside})
        if outside:
            other.append({**options, "params": outside})
    return hidden, other


def _count(groups: ParamGroups) -> tuple[int, int]:
    params = [p for g in groups for p in g["params"]]
    return len(params), sum(p.numel() for p in params)


def _millions(n: int) -> str:
    return f"{n / 1e6:.1f}M" if n >= 100_000 else f"{n:,}"


def split_line(special: str, hidden: ParamGroups, rest: str, other: ParamGroups) -> str:
    """The banner line, e.g. 'Muon on 36 hidden matrices (42.5M params), AdamW on 68 tensors
    (23.3M)'."""
    hn, hp = _count(hidden)
    on, op = _count(other)
    return (
        f"{special} on {hn} hidden matrices ({_millions(hp)} params), "
        f"{rest} on {on} tensors ({_millions(op)}: embeddings, head, 1-D)"
    )


class _MergedState(Mapping):
    """A read-only view ``{parameter: state}`` over several optimizers' states."""

    def __init__(self, optimizers: list[torch.optim.Optimizer]):
        self._optimizers = optimizers

    def __getitem__(self, param: Any) -> Any:
        for optimizer in self._optimizers:
            if param in optimizer.state:
                return optimizer.state[param]
        raise KeyError(param)

    def __iter__(self) -> Iterator[Any]:
        for optimizer in self._optimizers:
            yield from optimizer.state

    def __len__(self) -> int:
        return sum(len(o.state) for o in self._optimizers)


class SplitOptimizer(torch.optim.Optimizer):
    """Several optimizers over disjoint parameter groups, seen as one.

    - ``param_groups`` are the inner optimizers' own group dicts (in order), so the one lr
      scheduler drives all of them;
    - ``state`` is a read-only merged view (the memory ledger counts it as any optimizer's);
    - ``step``/``zero_grad`` delegate;
    - ``state_dict()`` has a normal optimizer's layout (parameters numbered in group order
      across the inner optimizers), so Accelerate checkpoints it and ``inspect-state`` reads it;
      ``load_state_dict`` splits it back by group counts into each inner optimizer.

    ``split_description``: the banner line.
    """

    def __init__(self, optimizers: list[torch.optim.Optimizer], split_description: str = ""):
        self.optimizers = optimizers
        self.split_description = split_description
        groups = [g for o in optimizers for g in o.param_groups]
        # defaults={}: torch's add_param_group then fills nothing into the inner groups.
        super().__init__(groups, {})
        self.param_groups = groups  # the very same dicts

    @property
    def state(self) -> Mapping[Any, Any]:  # type: ignore[override]
        return _MergedState(self.optimizers)

    @state.setter
    def state(self, value: Any) -> None:
        if value:
            raise AttributeError("SplitOptimizer.state is a view of the inner optimizers' states")

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for optimizer in self.optimizers:
            optimizer.step()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        for optimizer in self.optimizers:
            optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:  # type: ignore[override]
        state: dict[int, Any] = {}
        groups: list[dict[str, Any]] = []
        offset = 0
        for optimizer in self.optimizers:
            inner = optimizer.state_dict()
            for index, entry in inner["state"].items():
                state[index + offset] = entry
            for group in inner["param_groups"]:
                groups.append({**group, "params": [i + offset for i in group["params"]]})
            offset += sum(len(g["params"]) for g in optimizer.param_groups)
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:  # type: ignore[override]
        """Raises: ValueError when the saved groups differ from this optimizer's."""
        from effitrain.optim.in_backward import check_saved_groups

        saved_groups = check_saved_groups(self.param_groups, state_dict)
        saved_state = state_dict["state"]
        start = 0
        for optimizer in self.optimizers:
            mine = saved_groups[start : start + len(optimizer.param_groups)]
            start += len(optimizer.param_groups)
            ids = [i for g in mine for i in g["params"]]
            first = min(ids) if ids else 0
            optimizer.load_state_dict(
                {
                    "state": {i - first: saved_state[i] for i in ids if i in saved_state},
                    "param_groups": [
                        {**g, "params": [i - first for i in g["params"]]} for g in mine
                    ],
                }
            )
        # torch's load_state_dict gives each inner optimizer new group dicts: point ours at
        # them again, or the lr scheduler would set an lr no inner optimizer reads.
        self.param_groups = [g for o in self.optimizers for g in o.param_groups]


# --------------------------------------------------------------------------------------------
# Muon
# --------------------------------------------------------------------------------------------


def build_muon(model: torch.nn.Module, groups: ParamGroups, lr: float) -> SplitOptimizer:
    """torch.optim.Muon on the hidden matrices, torch.optim.AdamW on the rest, one lr.

    ``adjust_lr_fn="match_rms_adamw"`` (Moonlight's rule: Muon's lr is scaled by
    0.2·sqrt(max(rows, cols)), so its update has AdamW's RMS) lets the same lr and weight decay
    serve both, which the one shared scheduler needs.
    """
    hidden, other = hidden_matrices(model, groups)
    optimizers: list[torch.optim.Optimizer] = []
    if hidden:
        optimizers.append(torch.optim.Muon(hidden, lr=lr, adjust_lr_fn="match_rms_adamw"))
    if other:
        optimizers.append(torch.optim.AdamW(other, lr=lr))
    if not hidden:
        raise EffitrainError(
            "--optim muon: the model has no trainable 2-D hidden matrices for Muon (everything "
            "trainable is embeddings, head or 1-D); use adamw"
        )
    return SplitOptimizer(optimizers, split_line("Muon", hidden, "AdamW", other))


# --------------------------------------------------------------------------------------------
# GaLore and APOLLO: a projector object per matrix in the optimizer state
# --------------------------------------------------------------------------------------------

PROJECTOR = "projector"


def keep_projectors_in_state_dict(
    optimizer: torch.optim.Optimizer,
    make_projector: Callable[[dict[str, Any], dict[str, Any]], Any],
) -> None:
    """Save each ``state["projector"]`` object as the dict of its attributes but strings (the
    projection matrix ``ortho_matrix``, APOLLO's random ``seed``, …: tensors and Python scalars,
    which
    ``torch.load(weights_only=True)`` reads), and rebuild it on load with
    ``make_projector(group, state)`` + those attributes. Resume is then exact: the next step
    uses the same projection matrix, and the same next refresh seed.

    The memory ledger counts the live projector's attributes under ``projector.<name>``, the
    same keys the saved dict has.
    """

    def to_dict(_optimizer: Any, state_dict: dict[str, Any]) -> dict[str, Any]:
        state = {}
        for index, entry in state_dict["state"].items():
            projector = entry.get(PROJECTOR)
            if projector is not None and not isinstance(projector, Mapping):
                # Strings (proj_type) stay out: torch's load_state_dict would turn them into
                # generators; the rebuilt projector takes them from the group.
                saved = {k: v for k, v in vars(projector).items() if not isinstance(v, str)}
                entry = {**entry, PROJECTOR: saved}
            state[index] = entry
        return {**state_dict, "state": state}

    def from_dict(opt: torch.optim.Optimizer) -> None:
        for group in opt.param_groups:
            for param in group["params"]:
                entry = opt.state.get(param)
                saved = entry.get(PROJECTOR) if entry else None
                if isinstance(saved, Mapping):
                    projector = make_projector(group, entry)
                    vars(projector).update(saved)
                    entry[PROJECTOR] = projector

    optimizer.register_state_dict_post_hook(to_dict)
    # Not a load_state_dict post-hook: pytorch-optimizer's own load_state_dict walks the saved
    # state against the loaded one after torch's (and its hooks) ran, and expects the dict.
    load = optimizer.load_state_dict

    def load_state_dict(state_dict: Mapping[str, Any]) -> None:
        load(state_dict)
        from_dict(optimizer)

    optimizer.load_state_dict = load_state_dict  # type: ignore[method-assign]


def _refuse_lora(model: torch.nn.Module, name: str) -> None:
    from effitrain.models import is_lora

    if is_lora(model):
        raise EffitrainError(
            f"--optim {name} projects full-rank weight gradients to low rank; with --lora-rank "
            "the trained matrices are already low-rank adapters, so it saves nothing: use adamw"
        )


def projection_rank(hidden: ParamGroups, cap: int = 128) -> int:
    """The projection rank: a quarter of the narrowest hidden matrix side, at most ``cap``
    (distilbert-base 768 → 128, all-MiniLM-L6-v2 384 → 96, the tiny preset 128 → 32)."""
    narrowest = min(min(p.shape) for g in hidden for p in g["params"])
    return max(1, min(cap, narrowest // 4))


def _projected(hidden: ParamGroups, options: dict[str, Any]) -> ParamGroups:
    return [{**g, **options} for g in hidden]


def build_galore(model: torch.nn.Module, groups: ParamGroups, lr: float) -> torch.optim.Optimizer:
    """pytorch-optimizer's GaLore: Adam on the hidden matrices' gradients projected onto their
    top singular vectors (rank :func:`projection_rank`, SVD refreshed every 200 steps, scale
    0.25: the Trainer's defaults), plain AdamW (decoupled decay) on the other groups.

    Not galore-torch (the authors' package, what the Trainer uses): its projector keeps
    ``Vh[:rank]``, a *view*, so the whole min(m, n)² SVD factor stays alive per matrix;
    pytorch-optimizer clones the slice (docs/optimizers.md).
    """
    from pytorch_optimizer.optimizer.galore import GaLore
    from pytorch_optimizer.optimizer.utils.galore import GaLoreProjector

    _refuse_lora(model, "galore")
    hidden, other = hidden_matrices(model, groups)
    if not hidden:
        raise EffitrainError("--optim galore: the model has no trainable 2-D hidden matrices")
    rank = projection_rank(hidden)
    options = {"rank": rank, "update_proj_gap": 200, "scale": 0.25, "projection_type": "std"}
    optimizer = GaLore(_projected(hidden, options) + other, lr=lr)

    def make(group: dict[str, Any], _state: dict[str, Any]) -> Any:
        return GaLoreProjector(
            rank=group["rank"],
            update_proj_gap=group["update_proj_gap"],
            scale=group["scale"],
            projection_type=group["projection_type"],
        )

    keep_projectors_in_state_dict(optimizer, make)
    optimizer.split_description = split_line(f"GaLore (rank {rank})", hidden, "AdamW", other)
    return optimizer


def build_apollo(
    model: torch.nn.Module, groups: ParamGroups, lr: float, mini: bool = False
) -> torch.optim.Optimizer:
    """apollo-torch's APOLLOAdamW: random projection (rank :func:`projection_rank`, refreshed
    every 200 steps), channel-wise scaling of the raw gradient, scale 1 (the Trainer's
    defaults); ``mini``: APOLLO-Mini, rank 1 with tensor-wise scaling and scale 128 (the
    authors' setting)."""
    import logging

    # apollo_torch imports bitsandbytes, which logs a warning about an optional 4-bit CPU kernel
    # that has nothing to do with APOLLO (as for adamw-8bit in effitrain.optim).
    logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)
    from apollo_torch import APOLLOAdamW

    name = "apollo-mini" if mini else "apollo"
    _refuse_lora(model, name)
    hidden, other = hidden_matrices(model, groups)
    if not hidden:
        raise EffitrainError(f"--optim {name}: the model has no trainable 2-D hidden matrices")
    rank = 1 if mini else projection_rank(hidden)
    options = {
        "rank": rank,
        "proj": "random",
        "scale_type": "tensor" if mini else "channel",
        "scale": 128.0 if mini else 1.0,
        "update_proj_gap": 200,
        "proj_type": "std",
    }
    optimizer = APOLLOAdamW(_projected(hidden, options) + other, lr=lr)
    keep_projectors_in_state_dict(optimizer, optimizer._initialize_projector)
    label = "APOLLO-Mini (rank 1, tensor-wise)" if mini else f"APOLLO (rank {rank})"
    optimizer.split_description = split_line(label, hidden, "AdamW", other)
    return optimizer
