"""The built-in offline causal-LM demo: a corpus of short news reports, a byte-level BPE
tokenizer trained on it, and the "tiny-llama" preset's settings.

Nothing here downloads anything, and importing this module imports nothing heavy:
``datasets``, ``tokenizers`` and ``transformers`` are imported inside the functions.

The corpus (see ``_lm_generate.py``) is small and regular on purpose: the tiny preset, trained
from scratch for under a minute on a laptop CPU, brings validation perplexity from about the
vocabulary size down to a few, and its greedy samples read like the corpus.
"""

from __future__ import annotations

import functools
import random
from typing import TYPE_CHECKING, Any

from effitrain.demo._lm_generate import generate_documents

if TYPE_CHECKING:  # pragma: no cover
    import datasets
    import transformers

__all__ = [
    "DEMO_SAMPLE_PROMPT",
    "build_demo_corpus",
    "build_lm_tokenizer",
    "tiny_llama_config",
]

#: a prompt in the corpus's style; the trained demo model continues it with a report
DEMO_SAMPLE_PROMPT = "On Monday, the committee"

DEFAULT_NUM_TRAIN = 3000
DEFAULT_NUM_VALIDATION = 200

EOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|pad|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
#: special tokens, in id order (ids 0-3)
SPECIAL_TOKENS = [EOS_TOKEN, PAD_TOKEN, IM_START, IM_END]
#: BPE target size; the corpus has few distinct words, so training stops earlier (every word
#: is one token) and the vocabulary ends up smaller
_BPE_VOCAB_SIZE = 1024

#: ChatML, as Qwen and SmolLM write it. Assistant turns (content and <|im_end|>) sit inside
#: {% generation %} so ``return_assistant_tokens_mask=True`` marks them for completion-only loss.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['role'] == 'assistant' %}"
    "{% generation %}{{ message['content'] + '<|im_end|>' }}{% endgeneration %}"
    "{% else %}{{ message['content'] + '<|im_end|>' }}{% endif %}"
    "{{ '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# LlamaConfig settings of the "tiny-llama" preset, less the token ids (see tiny_llama_config).
_TINY_LLAMA_SETTINGS: dict[str, Any] = {
    "hidden_size": 96,
    "intermediate_size": 288,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "max_position_embeddings": 2048,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "initializer_range": 0.02,
    "attention_dropout": 0.0,
    # the embedding is most of a model this small; sharing it with the output halves that
    "tie_word_embeddings": True,
}


@functools.lru_cache(maxsize=4)
def _documents(seed: int, num_train: int, num_validation: int) -> tuple[tuple[str, ...], ...]:
    train_rng = random.Random(seed * 1_000_003 + 41)
    validation_rng = random.Random(seed * 1_000_003 + 53)
    train, train_meanings = generate_documents(train_rng, num_train)
    validation, _ = generate_documents(
        validation_rng, num_validation, exclude_meanings=train_meanings
    )
    return tuple(train), tuple(validation)


def build_demo_corpus(
    seed: int = 0,
    num_train: int = DEFAULT_NUM_TRAIN,
    num_validation: int = DEFAULT_NUM_VALIDATION,
) -> datasets.DatasetDict:
    """The demo corpus: splits ``train`` and ``validation``, one string column ``text``, one
    short news report (two to four sentences) per row.

    Fully determined by the arguments (its own ``random.Random``, never the global RNG).
    Validation reports are about events (lead-sentence meanings) that no training report is
    about, so no validation document appears in train.
    """
    import datasets

    if num_train < 1 or num_validation < 1:
        raise ValueError("num_train and num_validation must be at least 1")
    train, validation = _documents(seed, num_train, num_validation)
    features = datasets.Features({"text": datasets.Value("string")})
    return datasets.DatasetDict(
        {
            "train": datasets.Dataset.from_dict({"text": list(train)}, features=features),
            "validation": datasets.Dataset.from_dict({"text": list(validation)}, features=features),
        }
    )


@functools.lru_cache(maxsize=1)
def _trained_tokenizer_json() -> str:
    """The BPE tokenizer trained on the default corpus's train split, serialized.

    Cached, so each process trains it once. The trainer is deterministic (same text, same
    merges), so every process of a multi-process run gets the same ids.
    """
    from tokenizers import Tokenizer, decoders, pre_tokenizers, processors
    from tokenizers.models import BPE
    from tokenizers.trainers import BpeTrainer

    tok = Tokenizer(BPE())
    # GPT-2's byte-level scheme: any string encodes (no unknown token), and decodes back exactly
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = BpeTrainer(
        vocab_size=_BPE_VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    train, _ = _documents(0, DEFAULT_NUM_TRAIN, DEFAULT_NUM_VALIDATION)
    tok.train_from_iterator(train, trainer=trainer)
    return tok.to_str()


def build_lm_tokenizer(model_max_length: int = 2048) -> transformers.PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer trained on the demo corpus's train split, no download.

    ``<|endoftext|>`` is both bos and eos (GPT-2's convention), ``<|pad|>`` pads, and
    ``<|im_start|>``/``<|im_end|>`` delimit the turns of the ChatML ``chat_template``. Encoding
    adds no special tokens: the data pipeline appends eos to each document. A new tokenizer
    object on each call (change it freely); the training behind it runs once per process.
    """
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(_trained_tokenizer_json()),
        bos_token=EOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        extra_special_tokens=[IM_START, IM_END],
        model_max_length=model_max_length,
        padding_side="right",
        truncation_side="right",
        clean_up_tokenization_spaces=False,
        model_input_names=["input_ids", "attention_mask"],
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def tiny_llama_config() -> dict[str, Any]:
    """Keyword arguments for ``transformers.LlamaConfig`` of the "tiny-llama" preset.

    A new dict on each call (change it freely). ``vocab_size`` is ``len(build_lm_tokenizer())``
    and the bos/eos/pad ids are that tokenizer's.
    """
    tokenizer = build_lm_tokenizer()
    return {
        **_TINY_LLAMA_SETTINGS,
        "vocab_size": len(tokenizer),
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
    }
