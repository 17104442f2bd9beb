"""Adam-mini (the authors' package ``adam-mini``): one second moment per block, not per weight.

``Adam_mini`` partitions the parameters into blocks by name: query/key per attention head,
embeddings, values, attention output and MLP weights per output neuron (row), biases (and here
norms) elementwise as Adam. Its name lists know Llama/GPT names (``q_proj``, ``wq``, ``embed``,
``mlp``…), not DistilBERT's (``q_lin``, ``ffn.lin1``), MPNet's (``attn.q``) nor all of BERT's
(``intermediate``, ``pooler``, ``classifier``): unknown >=2-D weights fall back to one value for
the whole tensor, and 1-D LayerNorm weights under ``embeddings``/``output`` crash its per-row
branch (IndexError). We extend its public name sets (the way its own warnings tell users to) for
these families.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from effitrain.errors import EffitrainError

if TYPE_CHECKING:
    import torch

ParamGroups = list[dict[str, Any]]  # as effitrain.optim's (not imported: it imports this module)

EXTRA_NAMES = {
    # DistilBERT (q_lin…) and MPNet (attention.attn.q…); BERT's query/key/value are already in
    # Adam-mini's own sets. Without these, MPNet's four attention matrices fall through to one
    # second moment per whole matrix.
    "wqk_names": ("q_lin", "k_lin", "attn.q", "attn.k"),
    "wv_names": ("v_lin", "attn.v"),
    "attn_proj_names": ("out_lin", "attn.o"),
    "mlp_names": ("ffn", "intermediate", "pooler"),
    # The classification head, per class row (BERT's output.dense is caught by "output").
    "output_names": ("classifier",),
    # LayerNorm weights: elementwise Adam (their per-row branch needs 2-D tensors).
    "adam_block_names": ("norm",),
}
"""Names added to Adam-mini's own sets for DistilBERT, BERT/MiniLM and MPNet (all lower case)."""

PER_HEAD, PER_ROW, ELEMENTWISE, WHOLE = "per head", "per row", "elementwise", "whole tensor"


def model_dims(model: torch.nn.Module) -> tuple[int, int, int]:
    """(dim, n_heads, n_kv_heads) from the model's config (DistilBERT, BERT-style, Llama-style).

    Raises:
        EffitrainError: the config names no hidden size and head count.
    """
    config = getattr(model, "config", None)
    for dim_key, heads_key in (("dim", "n_heads"), ("hidden_size", "num_attention_heads")):
        dim, heads = getattr(config, dim_key, None), getattr(config, heads_key, None)
        if isinstance(dim, int) and isinstance(heads, int):
            kv_heads = getattr(config, "num_key_value_heads", None) or heads
            return dim, heads, kv_heads
    raise EffitrainError(
        "--optim adam-mini needs the model's hidden size and attention heads, but its config has "
        "neither dim/n_heads nor hidden_size/num_attention_heads; use --optim adamw"
    )


def block_kind(optimizer: torch.optim.Optimizer, name: str) -> str:
    """Which of Adam-mini's branches the parameter called ``name`` takes, in its own order."""
    name = name.lower()

    def has(names: set[str]) -> bool:
        return any(part in name for part in names)

    if has(optimizer.adam_block_names):
        return ELEMENTWISE
    if has(optimizer.wqk_names):
        return PER_HEAD
    row_sets = ("embd_names", "output_names", "wv_names", "mlp_names", "attn_proj_names")
    if any(has(getattr(optimizer, key)) for key in row_sets):
        return PER_ROW
    return WHOLE


def build(model: torch.nn.Module, groups: ParamGroups, lr: float) -> torch.optim.Optimizer:
    """``Adam_mini`` over ``model``, decaying what effitrain's ``groups`` decay (>=2-D weights).

    Raises:
        EffitrainError: no dims in the config, LoRA adapters, or a 1-D parameter that would
            reach one of Adam-mini's per-row/per-head branches (it would crash there).
    """
    from adam_mini import Adam_mini

    dim, n_heads, n_kv_heads = model_dims(model)
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if any("lora_" in n for n, _ in named):
        raise EffitrainError(
            "--optim adam-mini partitions the full model's weights by attention head and neuron, "
            "not LoRA adapters; with --lora-rank use --optim adamw"
        )
    decay = {id(p): g["weight_decay"] for g in groups for p in g["params"]}
    opt = Adam_mini(named, lr=lr, dim=dim, n_heads=n_heads, n_kv_heads=n_kv_heads, verbose=False)
    for key, extra in EXTRA_NAMES.items():
        getattr(opt, key).update(extra)
    # Its own no-decay rule is by name ("norm", "ln", "bias"); use effitrain's (>=2-D decays).
    for group in opt.param_groups:
        (param,) = group["params"]
        group["weight_decay"] = decay[id(param)]
        if param.ndim < 2 and block_kind(opt, group["name"]) != ELEMENTWISE:
            raise EffitrainError(
                f"--optim adam-mini cannot take the 1-D parameter '{group['name']}': Adam-mini "
                "treats it as a per-row block and crashes; use --optim adamw"
            )
    # Adam-mini counts the visible GPUs as its world (torch.cuda.device_count()) and, for
    # whole-tensor blocks, all-gathers sizes and all-reduces sums over them: that fails in one
    # process on a multi-GPU machine and on CPU processes (it moves the sum to CUDA). Replicated
    # (DDP) weights need no reduction, FSDP2's DTensors reduce their own sums.
    opt.world_size = 1
    return opt
