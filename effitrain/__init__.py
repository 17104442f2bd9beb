"""effitrain: memory-efficient training for Hugging Face models, with the memory made visible."""

__version__ = "0.1.0"
