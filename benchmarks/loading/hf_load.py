"""Plain transformers loading a checkpoint folder, load only: ``bf16`` (``from_pretrained(dtype=
torch.bfloat16)``) or ``4bit`` (a ``BitsAndBytesConfig``: nf4, double quantization, bf16
compute, as QLoRA loads). Prints ``loaded <seconds>`` when the model is there.

    python -m benchmarks.loading.hf_load FOLDER bf16|4bit
"""

from __future__ import annotations

import sys
import time


def main(folder: str, how: str) -> None:
    start = time.perf_counter()
    import torch
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    kwargs = {}
    if how == "4bit":
        kwargs["quantization_config"] = BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type="nf4",
            bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=torch.bfloat16,
        )
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16, **kwargs)
    print(f"loaded {time.perf_counter() - start:.2f}", flush=True)
    print(f"parameters {sum(p.numel() for p in model.parameters())}", flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:3])
