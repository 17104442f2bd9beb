"""The built-in offline demo: an MRPC-shaped paraphrase dataset, a tokenizer, a tiny model preset.

Nothing here downloads anything, and importing this module imports nothing heavy:
``datasets``, ``tokenizers`` and ``transformers`` are imported inside the functions.

The task: given two short news-style sentences, say whether the second is a paraphrase of
the first (label 1, ``equivalent``) or not (label 0, ``not_equivalent``). Paraphrases reword
the first sentence with synonyms, active/passive voice and moved time phrases or clauses;
non-paraphrases are restyled the same way but report a different event of the same shape
(who, what was done, to what, when, where, how all changed). A deliberately easy task with a
small vocabulary, so a tiny model learns it from scratch in seconds. See ``_generate.py``.
"""

from __future__ import annotations

import functools
import random
from typing import TYPE_CHECKING, Any

from effitrain.demo._generate import generate_pairs
from effitrain.demo._lexicon import all_words

if TYPE_CHECKING:  # pragma: no cover
    import datasets
    import transformers

__all__ = [
    "DEMO_LABEL_NAMES",
    "build_demo_dataset",
    "build_tokenizer",
    "tiny_model_config",
]

#: label names, in label-id order (MRPC's naming)
DEMO_LABEL_NAMES: list[str] = ["not_equivalent", "equivalent"]

DEFAULT_NUM_TRAIN = 3000
DEFAULT_NUM_VALIDATION = 400

# DistilBertConfig settings of the "tiny" preset, less vocab_size (see tiny_model_config).
_TINY_MODEL_SETTINGS: dict[str, Any] = {
    "max_position_embeddings": 64,
    "sinusoidal_pos_embds": False,
    "n_layers": 2,
    "n_heads": 4,
    "dim": 128,
    "hidden_dim": 256,
    # No dropout anywhere: on this small, clean task it only slows learning down.
    "dropout": 0.0,
    "attention_dropout": 0.0,
    "activation": "gelu",
    "initializer_range": 0.05,
    "seq_classif_dropout": 0.0,
    "pad_token_id": 0,
}

_SPECIAL_TOKENS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
_CHARS = "abcdefghijklmnopqrstuvwxyz0123456789"
_PUNCT = "!\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~"


@functools.lru_cache(maxsize=1)
def _vocab() -> tuple[str, ...]:
    """The tokenizer's vocabulary, in id order: specials, characters, demo words."""
    vocab = list(_SPECIAL_TOKENS)
    vocab += list(_CHARS) + list(_PUNCT)
    vocab += ["##" + c for c in _CHARS]
    seen = set(vocab)
    vocab += [w for w in all_words() if w not in seen]
    return tuple(vocab)


def tiny_model_config() -> dict[str, Any]:
    """Keyword arguments for ``transformers.DistilBertConfig`` of the "tiny" preset.

    A new dict on each call (change it freely). ``vocab_size`` is the size of
    ``build_tokenizer()``'s vocabulary; the caller adds ``num_labels``.
    """
    return {"vocab_size": len(_vocab()), **_TINY_MODEL_SETTINGS}


def build_demo_dataset(
    seed: int = 0,
    num_train: int = DEFAULT_NUM_TRAIN,
    num_validation: int = DEFAULT_NUM_VALIDATION,
) -> datasets.DatasetDict:
    """The demo paraphrase dataset: splits ``train`` and ``validation`` with columns
    ``sentence1``, ``sentence2`` (str) and ``label`` (ClassLabel, ``DEMO_LABEL_NAMES``).

    Fully determined by the arguments (its own ``random.Random``, never the global RNG).
    Labels are balanced (half each). The validation sentence1s never express a meaning used
    by any training sentence1, so validation pairs are never copies of training pairs.
    """
    import datasets

    if num_train < 1 or num_validation < 1:
        raise ValueError("num_train and num_validation must be at least 1")
    train, validation = _pairs(seed, num_train, num_validation)

    features = datasets.Features(
        {
            "sentence1": datasets.Value("string"),
            "sentence2": datasets.Value("string"),
            "label": datasets.ClassLabel(names=list(DEMO_LABEL_NAMES)),
        }
    )

    def to_dataset(rows: tuple[tuple[str, str, int], ...]) -> datasets.Dataset:
        return datasets.Dataset.from_dict(
            {
                "sentence1": [r[0] for r in rows],
                "sentence2": [r[1] for r in rows],
                "label": [r[2] for r in rows],
            },
            features=features,
        )

    return datasets.DatasetDict({"train": to_dataset(train), "validation": to_dataset(validation)})


@functools.lru_cache(maxsize=4)
def _pairs(
    seed: int, num_train: int, num_validation: int
) -> tuple[tuple[tuple[str, str, int], ...], tuple[tuple[str, str, int], ...]]:
    """The demo's training and validation rows, generated once per process (a fifth of a
    second; a process that trains several times, as the tests do, reuses them)."""
    train_rng = random.Random(seed * 1_000_003 + 17)
    validation_rng = random.Random(seed * 1_000_003 + 29)
    train, train_meanings = generate_pairs(train_rng, num_train)
    validation, _ = generate_pairs(
        validation_rng,
        num_validation,
        exclude_pairs={(s1, s2) for s1, s2, _ in train},
        exclude_meanings=train_meanings,
    )
    return tuple(train), tuple(validation)


def build_tokenizer(model_max_length: int = 512) -> transformers.PreTrainedTokenizerFast:
    """A BERT-style WordPiece tokenizer built in memory, no download.

    The vocabulary is the demo words plus the special tokens and single characters (and
    ``##``-prefixed letters and digits), so any English text still tokenizes: words outside the
    demo vocabulary fall back to characters instead of ``[UNK]``. Lowercases like
    ``bert-base-uncased``. Pairs are encoded ``[CLS] A [SEP] B [SEP]``.

    ``model_input_names`` is ``input_ids`` and ``attention_mask`` (what DistilBERT takes);
    ``token_type_ids`` (0 for A, 1 for B) are still produced on request with
    ``return_token_type_ids=True``.
    """
    from tokenizers import Tokenizer, normalizers, pre_tokenizers, processors
    from tokenizers.decoders import WordPiece as WordPieceDecoder
    from tokenizers.models import WordPiece
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate(_vocab())}
    tok = Tokenizer(WordPiece(vocab, unk_token="[UNK]", max_input_chars_per_word=100))
    tok.normalizer = normalizers.BertNormalizer(
        clean_text=True, handle_chinese_chars=True, strip_accents=None, lowercase=True
    )
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    cls_id, sep_id = vocab["[CLS]"], vocab["[SEP]"]
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]",
        pair="[CLS] $A:0 [SEP]:0 $B:1 [SEP]:1",
        special_tokens=[("[CLS]", cls_id), ("[SEP]", sep_id)],
    )
    tok.decoder = WordPieceDecoder(prefix="##")

    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="[UNK]",
        pad_token="[PAD]",
        cls_token="[CLS]",
        sep_token="[SEP]",
        mask_token="[MASK]",
        model_max_length=model_max_length,
        padding_side="right",
        truncation_side="right",
        model_input_names=["input_ids", "attention_mask"],
    )
