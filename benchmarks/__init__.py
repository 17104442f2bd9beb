"""One folder per question: ``python -m benchmarks.<topic>.run`` (see benchmarks/README.md)."""
