"""Model and tokenizer: a built-in preset (offline, random init), a hub id, or a local folder.

Presets and hub/local models go through the same functions: a ``*ForSequenceClassification``
model with ``num_labels``/``id2label`` taken from the dataset, or a ``*ForCausalLM`` model, and a
tokenizer with a pad token. Heavy libraries are imported inside the functions: ``PRESETS`` is
read by ``--help``.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from effitrain.errors import EffitrainError, first_line

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

# name -> (description, DistilBertConfig overrides on top of the demo's tiny config).
PRESETS: dict[str, tuple[str, dict[str, Any]]] = {
    "tiny": (
        "2-layer 128-dim DistilBERT, no dropout, random init (default; trains the demo in seconds)",
        {},
    ),
    "small": (
        "4-layer 256-dim DistilBERT, random init",
        {
            "dim": 256,
            "n_layers": 4,
            "n_heads": 4,
            "hidden_dim": 1024,
            "max_position_embeddings": 512,
        },
    ),
    "distilbert-base": (
        "distilbert-base-cased architecture (65.8M params), random init: real-size memory numbers",
        {
            "vocab_size": 28996,
            "dim": 768,
            "n_layers": 6,
            "n_heads": 12,
            "hidden_dim": 3072,
            "max_position_embeddings": 512,
        },
    ),
}


# name -> (description, transformers config class, settings). "tiny-llama"'s settings come from
# the causal-LM demo (effitrain.demo.lm) and the vocabulary from its tokenizer.
CAUSAL_PRESETS: dict[str, tuple[str, str, dict[str, Any]]] = {
    "tiny-llama": (
        "causal-lm: tiny Llama-style decoder, random init (default for --task causal-lm; "
        "trains the LM demo in under a minute)",
        "LlamaConfig",
        {},
    ),
    "qwen2.5-0.5b": (
        "causal-lm: Qwen2.5-0.5B's exact architecture (494M params, 151,936-token vocabulary), "
        "random init: real-size memory numbers",
        "Qwen2Config",
        {
            "vocab_size": 151936,
            "hidden_size": 896,
            "intermediate_size": 4864,
            "num_hidden_layers": 24,
            "num_attention_heads": 14,
            "num_key_value_heads": 2,
            "max_position_embeddings": 32768,
            "rope_theta": 1000000.0,
            "rms_norm_eps": 1e-6,
            "tie_word_embeddings": True,
            "hidden_act": "silu",
        },
    ),
}


@dataclass(frozen=True)
class LoadOptions:
    """How a checkpoint's weights are read (``from_pretrained``'s arguments); the levers say
    what they change (``effitrain.levers.load_options``). A preset (random init) is built in
    ``dtype`` and takes nothing else: its levers act on the built model."""

    dtype: str = "float32"
    """The dtype the weights are read in (each tensor cast as it is read), whatever the
    checkpoint's; a preset is built in it."""
    quantization_config: Any = None
    """transformers' quantization config, to quantize tensor by tensor while reading (None:
    read as they are)."""
    keep_unquantized: Callable[[Any], list[str]] | None = None
    """With ``quantization_config``: the names of the modules that keep their weights, given
    the model built on the meta device before anything is read (None: transformers' choice)."""
    device_map: Any = None
    """Where the weights go as they are read (None: the host)."""
    receive: str | None = None
    """How this process gets the weights when it does not read them, because the launch sends
    it the main process's (:attr:`effitrain.distributed.Launch.receives_weights`): the model is
    built from its config with its parameters on the meta device (buffers, computed at init,
    real), then ``"meta"``: left there, for Accelerate's FSDP2 ``prepare`` to fill each shard
    from the main process's (``fsdp_cpu_ram_efficient_loading``); ``"empty"``: materialized
    uninitialized where the run trains (:func:`materialize_empty`), for DDP's wrap to broadcast
    the main process's parameters and buffers. None: read here. See :attr:`receives`."""

    @property
    def receives(self) -> str | None:
        """:attr:`receive`, unless a quantization reads the checkpoint: bitsandbytes' quant
        state is neither a parameter nor a buffer, so no broadcast would carry it (Accelerate's
        FSDP2 loading skips a model with 4-bit weights too): every process reads and quantizes."""
        return self.receive if self.quantization_config is None else None

    def onto(self, device: Any) -> LoadOptions:
        """These options, reading straight onto ``device`` where the run trains on CUDA and a
        lever reads the checkpoint as it trains (in bf16, or quantized): nothing is converted on
        the host afterwards, and Accelerate's ``prepare`` then finds the model in place. Not
        for a plain fp32 read, which sharded launches load on the host."""
        if getattr(device, "type", None) != "cuda" or self.device_map is not None:
            return self
        if self.receives:
            return self  # nothing is read here
        if self.dtype == LoadOptions.dtype and self.quantization_config is None:
            return self
        return dataclasses.replace(self, device_map={"": device})

    def from_pretrained_kwargs(
        self, auto_class: Any = None, model_config: Any = None
    ) -> dict[str, Any]:
        """``from_pretrained``'s arguments. With :attr:`keep_unquantized`, the model is first
        built from ``model_config`` by ``auto_class`` on the meta device (no memory) to name the
        modules the quantization leaves as they are."""
        kwargs: dict[str, Any] = {"dtype": self.dtype}
        if self.quantization_config is not None:
            kwargs["quantization_config"] = self.quantization_config
            if self.keep_unquantized is not None:
                import copy

                import torch

                with torch.device("meta"):
                    skeleton = auto_class.from_config(copy.deepcopy(model_config))
                quantization = copy.copy(self.quantization_config)
                quantization.llm_int8_skip_modules = list(self.keep_unquantized(skeleton))
                kwargs["quantization_config"] = quantization
        if self.device_map is not None:
            kwargs["device_map"] = self.device_map
        return kwargs


def release_read_pages() -> int:
    """Drop from this process the pages of the safetensors files it still maps, where none was
    written: transformers keeps a checkpoint's files mapped for as long as a weight read in its
    own dtype is a view of them (QLoRA's embeddings, head and norms), and with them every page
    read for the weights it quantized or cast: on a 1.78B checkpoint, 2.5 GiB of resident
    pages the run never reads again (benchmarks/loading). The views stay valid: a page dropped
    from a private file mapping is read again from the file when touched. A mapping with a
    written (copy-on-write) page is left alone, as is any system without ``/proc/self/smaps``
    and ``madvise``. Returns the bytes dropped."""
    import ctypes
    import mmap

    try:
        # maps first: a few lines a mapping instead of smaps' twenty, which a process with torch
        # loaded takes tens of milliseconds to parse, for nothing where no checkpoint is mapped.
        if ".safetensors" not in Path("/proc/self/maps").read_text():
            return 0
        lines = Path("/proc/self/smaps").read_text().splitlines()
        madvise = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return 0
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    regions: list[tuple[int, int, dict[str, int]]] = []
    for line in lines:
        fields = line.split()
        if (
            "-" in fields[0] and len(fields) >= 5
        ):  # a mapping's header: range perms offset dev inode [path]
            start, end = (int(x, 16) for x in fields[0].split("-"))
            if len(fields) >= 6 and fields[-1].endswith(".safetensors"):
                regions.append((start, end, {}))
            else:
                regions.append((start, end, {"skip": 1}))
        elif regions and line.endswith("kB"):
            regions[-1][2][fields[0].rstrip(":")] = int(fields[1]) * 1024
    dropped = 0
    for start, end, sizes in regions:
        if sizes.get("skip") or sizes.get("Anonymous", 1) or not sizes.get("Rss"):
            continue
        if madvise(start, end - start, mmap.MADV_DONTNEED) == 0:
            dropped += sizes["Rss"]
    return dropped


def is_preset(name: str) -> bool:
    """A built-in preset of either task (random init: trained from scratch)."""
    return name in PRESETS or name in CAUSAL_PRESETS


def is_offline() -> bool:
    """True when the Hugging Face hub is switched off by environment."""
    return any(
        os.environ.get(var, "").upper() in {"1", "ON", "YES", "TRUE"}
        for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
    )


DOCUMENT_ATTENTION = "effitrain_documents"
"""The name a causal LM's attention takes in transformers' registries when it runs per document
(``effitrain.tasks.document_attention``): SDPA, told where each row's documents lie."""

DOCUMENT_LENGTHS = "document_lengths"
"""The batch key, and the model's keyword argument, of each row's documents' lengths (host
integers, in order, adding up to the row's length)."""

HUB_PROBE_SECONDS = 2.0
"""How long the one request that tells whether the hub can be reached may take."""
_unreachable_hub: str | None = None
"""The hub endpoint this process found it could not reach (it then went offline), else None."""


def _is_path(name: str) -> bool:
    return Path(name).exists() or name.startswith((".", "/", "~"))


def offline_unless_hub_reachable(name: str) -> None:
    """Before ``name`` (a hub id: not a preset, not a path) is looked up, one request with a
    short timeout tells whether the hub can be reached (once per process); where it cannot,
    this process goes offline, so that a cached copy loads and a missing one fails at once:
    huggingface_hub would retry each file for half a minute, logging every try."""
    global _unreachable_hub
    if is_preset(name) or _is_path(name) or is_offline():
        return
    from huggingface_hub import constants, get_session

    try:
        get_session().head(constants.ENDPOINT, timeout=HUB_PROBE_SECONDS)
    except Exception:  # noqa: BLE001 - any failure of this one request means unreachable
        _unreachable_hub = constants.ENDPOINT
        os.environ["HF_HUB_OFFLINE"] = "1"  # for this process's libraries and its children
        constants.HF_HUB_OFFLINE = True  # read once at import by huggingface_hub


def cannot_load(what: str, name: str, exc: BaseException) -> EffitrainError:
    presets = ", ".join([*PRESETS, *CAUSAL_PRESETS])
    if what == "model" and Path(name).is_dir() and not (Path(name) / "config.json").exists():
        reason = "the folder has no config.json"
    elif Path(name).exists():
        reason = f"the folder exists but is not a saved {what} ({first_line(exc)})"
    elif name.startswith((".", "/", "~")):
        reason = "no such folder"
    elif is_offline():
        hub = (
            f"the hub ({_unreachable_hub}) cannot be reached"
            if _unreachable_hub
            else "the hub is offline (HF_HUB_OFFLINE=1)"
        )
        return EffitrainError(
            f"cannot load {what} '{name}': {hub} and no copy is cached; offline, use a preset "
            f"({presets}) or a local folder saved with save_pretrained"
        )
    else:
        reason = first_line(exc)
    return EffitrainError(f"cannot load {what} '{name}': {reason}. Presets: {presets}")


def preset_settings(name: str) -> dict[str, Any]:
    """DistilBertConfig keyword arguments of a preset (the demo's tiny config plus overrides)."""
    from effitrain.demo import tiny_model_config

    return {**tiny_model_config(), **PRESETS[name][1]}


TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "vocab.txt",
    "vocab.json",
    "tokenizer.model",
    "spiece.model",
)
"""A local folder holds a tokenizer if it has one of these (what save_pretrained writes)."""


def load_tokenizer(name: str) -> PreTrainedTokenizerBase:
    """The tokenizer for a preset, hub id or local folder; a pad token is guaranteed.

    Raises:
        EffitrainError: it cannot be loaded (the message says why, offline included).
    """
    if name in PRESETS:
        from effitrain.demo import build_tokenizer

        max_positions = preset_settings(name)["max_position_embeddings"]
        return build_tokenizer(model_max_length=max_positions)
    if name in CAUSAL_PRESETS:
        from effitrain.demo.lm import build_lm_tokenizer

        max_positions = causal_preset_settings(name)["max_position_embeddings"]
        return build_lm_tokenizer(model_max_length=max_positions)
    from transformers import AutoTokenizer

    folder = Path(name)
    if folder.is_dir() and not any((folder / f).exists() for f in TOKENIZER_FILES):
        # transformers would build a near-empty tokenizer from the config alone: every word
        # would become one unknown token.
        raise EffitrainError(
            f"cannot load tokenizer from '{name}': the folder has no tokenizer files "
            f"({', '.join(TOKENIZER_FILES[:3])} …); save it with tokenizer.save_pretrained"
        )
    offline_unless_hub_reachable(name)
    try:
        tokenizer = AutoTokenizer.from_pretrained(name)
    except (OSError, ValueError, KeyError) as exc:
        raise cannot_load("tokenizer", name, exc) from exc
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise EffitrainError(
                f"tokenizer of '{name}' has neither a pad nor an eos token; "
                "save one with a pad token (tokenizer.add_special_tokens({'pad_token': '[PAD]'}))"
            )
        # Decoder-only models (GPT-2 style) classify fine with eos as padding.
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_model(
    name: str,
    label_names: list[str],
    tokenizer: PreTrainedTokenizerBase,
    options: LoadOptions | None = None,
    notes: list[str] | None = None,
) -> PreTrainedModel:
    """Build a preset or load a pretrained model with a classification head for these labels,
    read as ``options`` say (default: fp32).

    A head the checkpoint lacks, or has for another number of labels, is freshly initialised,
    as in the Trainer, and named in a note added to ``notes``; any other weight that does not
    load refuses the run (:func:`check_loaded`).

    Raises:
        EffitrainError: the model cannot be loaded.
    """
    from transformers import AutoModelForSequenceClassification

    labels = _label_fields(label_names)
    options = options or LoadOptions()
    if name in PRESETS:
        from transformers import DistilBertConfig

        settings = preset_settings(name)
        settings["vocab_size"] = max(settings.get("vocab_size", 0), len(tokenizer))
        settings["pad_token_id"] = tokenizer.pad_token_id
        config = DistilBertConfig(**settings, **labels)
        if options.receives:
            return empty_model(AutoModelForSequenceClassification, config, options.dtype)
        # Built in the dtype it trains in: the same values as fp32's init, rounded.
        return AutoModelForSequenceClassification.from_config(config, dtype=options.dtype)

    config = load_model_config(name, **labels)
    if getattr(config, "pad_token_id", None) is None:
        config.pad_token_id = tokenizer.pad_token_id
    try:
        if options.receives:
            return empty_model(AutoModelForSequenceClassification, config, options.dtype)
        return read_checkpoint(
            AutoModelForSequenceClassification, name, options, config, new_head=True, notes=notes
        )
    except (OSError, ValueError, KeyError) as exc:
        raise cannot_load("model", name, exc) from exc


def read_checkpoint(
    auto_class: Any,
    name: str,
    options: LoadOptions,
    model_config: Any,
    new_head: bool,
    notes: list[str] | None,
) -> PreTrainedModel:
    """``auto_class.from_pretrained(name)``, read as ``options`` say, its loading checked
    (:func:`check_loaded`; ``new_head``: the task initializes its head on purpose).

    Raises:
        EffitrainError: a weight file is truncated or a pickle, or weights did not load.
    """
    import pickle

    from safetensors import SafetensorError

    offline_unless_hub_reachable(name)
    try:
        # In the options' dtype (fp32 by default), whatever the checkpoint's (transformers 5
        # keeps it by default): the weights' dtype is the levers' choice. Mismatched shapes
        # are reported, not raised: check_loaded refuses them outside a new head.
        model, info = auto_class.from_pretrained(
            name,
            **({"config": model_config} if model_config is not None else {}),
            ignore_mismatched_sizes=True,
            output_loading_info=True,
            **options.from_pretrained_kwargs(auto_class, model_config),
        )
    except SafetensorError as exc:
        file = _first_unreadable(name, "*.safetensors") or "a .safetensors file"
        raise EffitrainError(
            f"cannot load model '{name}': {file} is truncated or corrupt ({first_line(exc)}); "
            "download or save it again"
        ) from exc
    except pickle.UnpicklingError as exc:
        file = _first_unreadable(name, "*.bin") or "pytorch_model.bin"
        raise EffitrainError(
            f"cannot load model '{name}': {file} is a pickle holding more than tensors, refused "
            "(untrusted pickles are never unpickled with code execution); if you trust it, "
            'convert it once: python -c "import torch, safetensors.torch as st; d = torch.load('
            f"'{file}', weights_only=False); st.save_file({{k: v.clone() for k, v in d.items() "
            f"if torch.is_tensor(v)}}, '{Path(file).with_name('model.safetensors')}', "
            "{'format': 'pt'})\" and remove the .bin"
        ) from exc
    check_loaded(name, model, info, new_head, notes)
    release_read_pages()
    return model


def _first_unreadable(name: str, pattern: str) -> str | None:
    """The first of the checkpoint's files matching ``pattern`` (its folder, or its cached
    snapshot) that safetensors or torch's weights-only loader cannot read, else None."""
    folder = Path(name)
    if not folder.is_dir():
        try:
            from huggingface_hub import snapshot_download

            folder = Path(snapshot_download(name, local_files_only=True))
        except Exception:  # noqa: BLE001 - not cached as a snapshot: the file goes unnamed
            return None
    for path in sorted(folder.glob(pattern)):
        try:
            if path.suffix == ".safetensors":
                from safetensors import safe_open

                with safe_open(str(path), framework="pt"):
                    pass
            else:
                import torch

                torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except Exception:  # noqa: BLE001 - unreadable, whatever the reason
            return str(path)
    return None


LISTED_KEYS = 4
"""How many weight names a note lists before it counts the rest."""


def check_loaded(
    name: str, model: Any, info: dict[str, Any], new_head: bool, notes: list[str] | None
) -> None:
    """Refuse a model whose checkpoint did not fill it: weights missing from the checkpoint
    (they would train from random values), in it with no place in the model, or of another
    shape. Except, named in one note added to ``notes``: a task's head outside the base model
    (``new_head``: a classification head, and the base model's pooler it reads), which the
    task initializes on purpose, and a head of the checkpoint's own that this task does not
    use. Tied weights (an output layer tied to the embeddings) are not missing: transformers
    ties them after reading.

    Raises:
        EffitrainError: one line naming how many weights and one of each, and the likely cause.
    """
    prefix = getattr(model, "base_model_prefix", "")
    base = f"{prefix}." if prefix and hasattr(model, prefix) else None

    def outside_base(key: str) -> bool:
        return base is not None and (not key.startswith(base) or key.startswith(f"{base}pooler."))

    mismatched = {
        key: (tuple(saved), tuple(built)) for key, saved, built in info["mismatched_keys"]
    }
    absent = sorted(info["missing_keys"]) + sorted(mismatched)
    new = [key for key in absent if new_head and outside_base(key)]
    missing = [key for key in sorted(info["missing_keys"]) if key not in new]
    reshaped = [key for key in sorted(mismatched) if key not in new]
    unexpected = sorted(info["unexpected_keys"])
    dropped = [key for key in unexpected if outside_base(key)]
    if not (missing or reshaped):  # else they tell the cause: the weights of another model
        unexpected = [key for key in unexpected if key not in dropped]
    problems = []
    if missing:
        problems.append(
            f"{len(missing)} weight(s) missing from the checkpoint (e.g. {missing[0]}) would "
            "train from random values"
        )
    if unexpected:
        problems.append(
            f"{len(unexpected)} weight(s) in the checkpoint have no place in the model (e.g. "
            f"{unexpected[0]})"
        )
    if reshaped:
        saved, built = mismatched[reshaped[0]]
        problems.append(
            f"{len(reshaped)} weight(s) have another shape in the checkpoint (e.g. {reshaped[0]}: "
            f"{list(saved)} saved, {list(built)} in the model)"
        )
    if info.get("error_msgs"):
        problems.append(str(info["error_msgs"][0]).strip().splitlines()[0])
    if problems:
        architecture = f"{type(model).__name__}, model_type {model.config.model_type}"
        if missing and not (unexpected or reshaped):
            cause = "a truncated or partial checkpoint, or a config.json that does not describe it"
        elif reshaped and not (missing or unexpected):
            cause = f"a config.json ({architecture}) whose sizes do not match the weights"
        else:
            cause = f"a config.json whose architecture ({architecture}) does not match the weights"
        raise EffitrainError(
            f"cannot load model '{name}': {'; '.join(problems)}. Likely cause: {cause}"
        )
    said = []
    if new:
        said.append(
            f"{_listed(new)} {'is' if len(new) == 1 else 'are'} new: initialized for this task"
        )
    if dropped:
        said.append(f"the checkpoint's own head ({_listed(dropped)}) is not used by this task")
    if said and notes is not None:
        notes.append("; ".join(said))


def _listed(keys: list[str]) -> str:
    shown = ", ".join(keys[:LISTED_KEYS])
    return shown if len(keys) <= LISTED_KEYS else f"{shown} and {len(keys) - LISTED_KEYS} more"


def causal_preset_settings(name: str) -> dict[str, Any]:
    """Config keyword arguments of a causal-LM preset (vocab_size at least the tokenizer's)."""
    from effitrain.demo.lm import tiny_llama_config

    return {**tiny_llama_config(), **CAUSAL_PRESETS[name][2]}


def load_model_config(name: str, **kwargs: Any) -> Any:
    """A hub id's or folder's transformers config (``kwargs`` override its fields).

    Raises:
        EffitrainError: it cannot be read (the message says why, offline included).
    """
    from transformers import AutoConfig

    offline_unless_hub_reachable(name)
    try:
        return AutoConfig.from_pretrained(name, **kwargs)
    except (OSError, ValueError, KeyError) as exc:
        raise cannot_load("model", name, exc) from exc


def model_from_config(
    name: str,
    tokenizer: PreTrainedTokenizerBase | None,
    causal_lm: bool,
    label_names: list[str] = (),
) -> PreTrainedModel:
    """The model a run would train, built from its config only: no weights are read (a hub id
    needs its config.json alone). Call it under ``torch.device("meta")`` to allocate nothing.

    ``tokenizer`` may be None for a hub id or folder without one: the pad token is then the
    config's own, else its (first) eos token, as :func:`load_tokenizer` would choose."""
    if name in PRESETS:
        return load_model(name, list(label_names), tokenizer)
    if name in CAUSAL_PRESETS:
        return load_causal_lm(name, tokenizer)
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    labels = {} if causal_lm else _label_fields(list(label_names))
    model_config = load_model_config(name, **labels)
    if getattr(model_config, "pad_token_id", None) is None:
        model_config.pad_token_id = (
            tokenizer.pad_token_id if tokenizer is not None else config_eos_token_id(model_config)
        )
    # fp32 whatever the checkpoint's dtype (from_config would take config.json's torch_dtype):
    # on the meta device the levers' bf16 cast costs nothing, where a run reads in bf16.
    auto = AutoModelForCausalLM if causal_lm else AutoModelForSequenceClassification
    model = auto.from_config(model_config, dtype="float32")
    if causal_lm:
        model.config.use_cache = False  # as _for_training leaves a loaded causal LM
    return model


def config_eos_token_id(model_config: Any) -> int | None:
    """A transformers config's eos token id (the first, where it lists several)."""
    eos = getattr(model_config, "eos_token_id", None)
    if isinstance(eos, list | tuple):
        return eos[0] if eos else None
    return eos


def max_positions(model_config: Any) -> int | None:
    """The longest sequence a transformers config's positions allow, where it says."""
    for key in ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length"):
        value = getattr(model_config, key, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


ROTARY_KEYS = ("rope_parameters", "rope_theta", "rope_scaling")
"""Where a transformers config says its positions are rotary."""


def rotary_positions(name: str) -> bool:
    """Whether a model's positions are rotary (RoPE: computed for any index, so a sequence may
    run past those it was trained on) rather than a learned table (nothing past its last row).

    Raises:
        EffitrainError: the model's config cannot be read.
    """
    if name in PRESETS:
        return False  # DistilBERT's learned positions
    if name in CAUSAL_PRESETS:
        return True  # Llama's and Qwen2's
    model_config = load_model_config(name)
    return any(getattr(model_config, key, None) for key in ROTARY_KEYS)


def sequence_limit(name: str, limit: int, max_length: int, beyond_positions: bool) -> int:
    """The longest sequence a run of model ``name`` takes: ``limit`` (its tokenizer's
    model_max_length, or its positions), or with ``--beyond-positions`` at least
    ``max_length``.

    Raises:
        EffitrainError: ``--beyond-positions`` for a model whose positions are learned.
    """
    if not beyond_positions:
        return limit
    if not rotary_positions(name):
        raise EffitrainError(
            f"--beyond-positions: {name} learns a table of positions (none past its last "
            "exists); only models with rotary positions (RoPE) take it"
        )
    return max(limit, max_length)


def capped_length(max_length: int, limit: int, notes: list[str]) -> int:
    """``--max-length`` capped by the longest sequence the model takes (``limit``: its
    tokenizer's ``model_max_length``; longer inputs would index past its position embeddings),
    as train and estimate cut sequences; a note added to ``notes`` says so where a length the
    user chose is cut (the default, 128, is above the tiny preset's 64 positions)."""
    from effitrain.config import default_for

    if max_length <= limit:
        return max_length
    if max_length != default_for("max_length"):
        notes.append(
            f"--max-length {max_length:,} is above the {limit:,} positions the model takes: "
            f"sequences are cut at {limit:,} tokens"
        )
    return limit


def _label_fields(label_names: list[str]) -> dict[str, Any]:
    """A classification config's label fields for these label names."""
    id2label = dict(enumerate(label_names))
    return {
        "num_labels": len(label_names),
        "id2label": id2label,
        "label2id": {label: i for i, label in id2label.items()},
    }


def load_causal_lm(
    name: str,
    tokenizer: PreTrainedTokenizerBase,
    options: LoadOptions | None = None,
    notes: list[str] | None = None,
) -> PreTrainedModel:
    """Build a causal-LM preset (random init) or load a pretrained ``AutoModelForCausalLM``,
    read as ``options`` say (default: fp32), every weight loaded (:func:`check_loaded`; the
    output layer is no new head: a checkpoint without it is refused, unless it is tied).

    Raises:
        EffitrainError: the model cannot be loaded, or has no causal-LM head.
    """
    import transformers

    options = options or LoadOptions()
    auto = transformers.AutoModelForCausalLM
    if name in CAUSAL_PRESETS:
        settings = causal_preset_settings(name)
        settings["vocab_size"] = max(settings["vocab_size"], len(tokenizer))
        for key in ("pad_token_id", "bos_token_id", "eos_token_id"):
            settings[key] = getattr(tokenizer, key)
        config = getattr(transformers, CAUSAL_PRESETS[name][1])(**settings)
        if options.receives:
            return _for_training(empty_model(auto, config, options.dtype), tokenizer)
        # Built in the dtype it trains in, as load_model builds its presets.
        return _for_training(auto.from_config(config, dtype=options.dtype), tokenizer)
    # The config where the model is built from it alone (a process that receives its weights),
    # or where the options need the model's modules (a quantization's kept ones).
    needed = options.receives or options.keep_unquantized is not None
    config = load_model_config(name) if needed else None
    try:
        if options.receives:
            model = empty_model(auto, config, options.dtype, generation_from=name)
        else:
            model = read_checkpoint(auto, name, options, config, new_head=False, notes=notes)
    except ValueError as exc:
        if "Unrecognized configuration class" in str(exc):
            raise EffitrainError(
                f"'{name}' has no causal-LM head (its architecture is not a decoder language "
                "model); use --task sequence-classification, or a causal LM"
            ) from exc
        raise cannot_load("model", name, exc) from exc
    except (OSError, KeyError) as exc:
        raise cannot_load("model", name, exc) from exc
    if model.config.pad_token_id is None:
        model.config.pad_token_id = tokenizer.pad_token_id
    return _for_training(model, tokenizer)


def empty_model(
    auto_class: Any, model_config: Any, dtype: str, generation_from: str | None = None
) -> PreTrainedModel:
    """The model ``from_pretrained`` would give, with no weight read: built from its config with
    the parameters on the meta device (no memory) and the buffers real (computed at init, as
    position ids and rotary frequencies are; not every one is in a checkpoint), tied weights
    tied, in eval mode as ``from_pretrained`` leaves it; ``generation_from``: the folder or hub
    id whose ``generation_config.json`` it reads, as ``from_pretrained`` does (a few bytes).
    For a process that receives its weights (:attr:`LoadOptions.receive`)."""
    from accelerate import init_empty_weights

    with init_empty_weights(include_buffers=False):
        model = auto_class.from_config(model_config, dtype=dtype)
    model.tie_weights()  # init_empty_weights replaces each parameter it registers: tie again
    if generation_from is not None and model.can_generate():
        import contextlib

        from transformers import GenerationConfig

        with contextlib.suppress(OSError):  # none saved: from_config's, from the model config
            model.generation_config = GenerationConfig.from_pretrained(generation_from)
    return model.eval()


def materialize_empty(model: Any, device: Any) -> None:
    """Give every meta parameter and buffer of ``model`` uninitialized storage on ``device``
    (a tensor shared by several modules, tied weights, stays shared), for a process whose
    launch then sends it the main process's values (:attr:`LoadOptions.receive`: ``empty``)."""
    import torch

    made: dict[int, Any] = {}

    def empty(t: Any, parameter: bool) -> Any:
        if id(t) not in made:
            new = torch.empty_like(t, device=device)
            made[id(t)] = torch.nn.Parameter(new, t.requires_grad) if parameter else new
        return made[id(t)]

    for module in model.modules():
        for tensors, parameter in ((module._parameters, True), (module._buffers, False)):
            for name, t in tensors.items():
                if t is not None and t.device.type == "meta":
                    tensors[name] = empty(t, parameter)


def _for_training(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> PreTrainedModel:
    """No key/value cache in training forwards (with one, transformers skips the packed-document
    mask: packed documents would attend to each other); generation asks for it. Padding on the
    right, where absolute positions (GPT-2) stay those of the text."""
    model.config.use_cache = False
    tokenizer.padding_side = "right"
    return model


# What a lever's wrapper hides (LoRA's peft model): the registry and the levers look through it.
def is_lora(model: Any) -> bool:
    """Whether ``model`` (unwrapped) is a peft model."""
    return hasattr(model, "peft_config") and hasattr(model, "get_base_model")


def base_model(model: Any) -> Any:
    """The transformers model under a lever's wrapper (LoRA's peft model), else ``model``."""
    return model.get_base_model() if is_lora(model) else model


def is_causal_lm(model: Any) -> bool:
    """Whether ``model`` (unwrapped, under LoRA or not) is a transformers causal LM."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return type(base_model(model)).__name__ in set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values())


def head_modules(model: torch.nn.Module) -> list[str]:
    """The classification head: the top-level modules with parameters outside the base model,
    and the base model's ``pooler`` where the head reads it (BERT: ``bert.pooler``). A causal
    LM has none that trains in full: its ``lm_head`` is pretrained (often the embeddings)."""
    if is_causal_lm(model):
        return []

    def has_parameters(module: Any) -> bool:
        return any(True for _ in module.parameters())

    base = getattr(model, "base_model_prefix", "")
    head = [
        name for name, child in model.named_children() if name != base and has_parameters(child)
    ]
    pooler = getattr(getattr(model, base, None), "pooler", None)
    if pooler is not None and has_parameters(pooler):
        head.insert(0, f"{base}.pooler")
    return head
