"""``python -m effitrain`` (and ``accelerate launch -m effitrain ...``)."""

from effitrain.cli import main

if __name__ == "__main__":
    main()
