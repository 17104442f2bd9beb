"""``effitrain train``: options -> TrainConfig -> train() -> report."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from effitrain.cli.error_handling import user_errors
from effitrain.cli.options import CONFIG_FILE, PRESETS_HELP, config_options
from effitrain.cli.quiet import quiet_libraries

if TYPE_CHECKING:
    from effitrain.config import TrainConfig


@config_options(extra_help={"model": PRESETS_HELP})
def train(
    config_file: Annotated[Path | None, CONFIG_FILE] = None, *, overrides: dict[str, Any]
) -> None:
    """Train a classifier or a causal LM and report what its memory really costs.

    With no options: the built-in tiny model on the built-in demo data, offline, in under a
    minute. Options given on the command line override the --config file, which overrides the
    defaults.
    """
    with user_errors():
        quiet_libraries()
        from effitrain.build import checked_config

        config = checked_config(config_file, overrides)
        run(config)


def run(config: TrainConfig) -> None:
    """Train with the run's one reporter, print the results, write the metrics JSON."""
    from effitrain.report.live import Reporter
    from effitrain.report.metrics_json import write_metrics_json
    from effitrain.signals import TrainingStopped
    from effitrain.training import train

    reporter = Reporter(quiet=config.quiet)
    try:
        result = train(config, reporter)
    except TrainingStopped as stop:
        # A signal stopped the run; it saved a checkpoint and said how to resume.
        raise typer.Exit(stop.exit_code) from None
    reporter.finished(result)
    if config.metrics_json and reporter.enabled:  # enabled: the main process
        write_metrics_json(config.metrics_json, result.to_dict())
        reporter.saved_metrics(config.metrics_json)
