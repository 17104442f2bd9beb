"""The options that ``train``, ``estimate`` and ``compare`` share: one declaration each.

An option's declaration is its :class:`effitrain.config.TrainConfig` field: the field's name is
the flag (``batch_size`` -> ``--batch-size``), its default the default, and its
:data:`effitrain.config.OPTIONS` entry the rest (help, panel, off flag, metavar, choices).
:func:`config_options` turns the fields into a command's typer parameters (typer reads the
signature it builds) and hands the command the values given on the command line as overrides,
so that YAML files and defaults keep their order. What is only the CLI's lives here: the
presets' help (the config cannot import the models) and ``--config``.

Imports nothing heavy: ``--help`` stays instant.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import typing
from collections.abc import Callable, Collection, Mapping
from typing import Annotated, Any

import typer

from effitrain.config import HELP_PANELS, OPTIONS, TrainConfig
from effitrain.models import CAUSAL_PRESETS, PRESETS


def panels() -> dict[str, tuple[str, ...]]:
    """TrainConfig's fields by the help panel each declares, in the option table's order."""
    return {
        panel: tuple(name for name, spec in OPTIONS.items() if spec.panel == panel)
        for panel in HELP_PANELS
    }


PRESET_NAMES = (
    " Presets: " + ", ".join([*PRESETS, *CAUSAL_PRESETS]) + " (see effitrain train --help)."
)
PRESETS_HELP = (
    " Presets: "
    + "; ".join(f"[bold]{name}[/]: {desc}" for name, (desc, _) in PRESETS.items())
    + "; "
    + "; ".join(f"[bold]{name}[/]: {desc}" for name, (desc, _, _) in CAUSAL_PRESETS.items())
    + "."
)

CONFIG_FILE = typer.Option(
    "--config",
    help="YAML file of options (keys as in `effitrain train --help`, e.g. batch_size: 16); "
    "options given on the command line override it.",
    metavar="FILE",
    show_default=False,
)

_GIVEN = ("COMMANDLINE", "ENVIRONMENT")


def config_fields() -> list[str]:
    """The names of TrainConfig's fields, in declaration order."""
    return [f.name for f in dataclasses.fields(TrainConfig)]


def given(ctx: typer.Context, name: str) -> bool:
    """Whether the option ``name`` was given on the command line (not left at its default).

    By the source's name: typer may bundle its own click, whose ParameterSource is not click's.
    """
    return getattr(ctx.get_parameter_source(name), "name", "") in _GIVEN


def given_values(
    ctx: typer.Context, values: Mapping[str, Any], names: Collection[str]
) -> dict[str, Any]:
    """The values of the options in ``names`` that were given on the command line, by name:
    the overrides that :func:`effitrain.build.checked_config` takes. A list option given more
    than once is every value given, as one comma-separated string (the config splits it)."""
    return {
        name: ",".join(values[name]) if isinstance(values[name], (list, tuple)) else values[name]
        for name in names
        if name in values and given(ctx, name)
    }


def _cli_type(annotation: Any) -> Any:
    """The type typer parses: a list field is comma-separated strings, the option repeatable
    (:func:`given_values` joins them; the config splits them)."""
    args = typing.get_args(annotation)
    optional = type(None) in args
    inner = next((a for a in args if a is not type(None)), annotation) if optional else annotation
    if typing.get_origin(inner) is list:
        inner = list[str]
    return inner | None if optional else inner


def config_parameter(
    name: str,
    default: Any,
    annotation: Any,
    *,
    extra: str = "",
    shown: str | None = None,
    hidden: bool = False,
) -> inspect.Parameter:
    """The typer parameter of config field ``name``, as its :data:`~effitrain.config.OPTIONS`
    entry declares it. ``default``: the value --help shows (the config's, or the command's);
    ``shown``: the text --help shows instead of it; ``extra``: text appended to the help."""
    spec = OPTIONS[name]
    cli_type = _cli_type(annotation)
    is_flag = spec.off is not None or cli_type is bool
    show_default: bool | str = shown or spec.default_text or (default is not None)
    if default is False:
        show_default = False  # a flag that is off unless given: nothing to show
    info = typer.Option(
        spec.declaration,
        help=spec.help + extra,
        rich_help_panel=spec.panel,
        show_default=show_default,
        metavar="" if is_flag else spec.value_text or "N",  # N: a count, the rest's value
        hidden=hidden,
    )
    return inspect.Parameter(
        name, inspect.Parameter.KEYWORD_ONLY, default=default, annotation=Annotated[cli_type, info]
    )


def config_options(
    *,
    exclude: Collection[str] = (),
    hidden: Collection[str] = (),
    defaults: Mapping[str, Any] | None = None,
    default_text: Mapping[str, str] | None = None,
    extra_help: Mapping[str, str] | None = None,
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Give a command the options of TrainConfig's fields, declared once (above).

    The command keeps its own parameters and takes ``overrides``: the fields given on the
    command line, by name (what :func:`effitrain.build.checked_config` takes); a command that
    also needs the click context declares ``ctx``.

    Args:
        exclude: fields the command does not take.
        hidden: fields it takes but does not list in --help.
        defaults: defaults that are the command's own, shown by --help (the command applies
            them itself: ``overrides`` holds only what was given).
        default_text: what --help says the default is, where the value alone misleads.
        extra_help: text appended to a field's help in this command.
    """
    defaults, default_text, extra_help = defaults or {}, default_text or {}, extra_help or {}
    hints = typing.get_type_hints(TrainConfig)
    fields = [name for name in config_fields() if name not in exclude]

    def decorate(command: Callable[..., Any]) -> Callable[..., Any]:
        own = inspect.signature(command, eval_str=True).parameters
        clash = set(own) & set(fields)
        assert not clash, f"{command.__name__} declares {clash} itself: exclude them"
        wants_ctx = "ctx" in own
        options = [
            *(p.replace(kind=p.KEYWORD_ONLY) for p in own.values() if p.name not in _RESERVED),
            *(
                config_parameter(
                    name,
                    defaults.get(name, TrainConfig.__dataclass_fields__[name].default),
                    hints[name],
                    extra=extra_help.get(name, ""),
                    shown=default_text.get(name),
                    hidden=name in hidden,
                )
                for name in fields
            ),
        ]
        options.sort(key=_panel_rank)  # stable: a command's own options lead their panel
        ctx_param = inspect.Parameter(
            "ctx", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=typer.Context
        )
        params = [ctx_param, *options]

        @functools.wraps(command)
        def run(ctx: typer.Context, **values: Any) -> Any:
            overrides = given_values(ctx, values, fields)
            for name in fields:
                values.pop(name, None)
            if wants_ctx:
                values["ctx"] = ctx
            return command(**values, overrides=overrides)

        run.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
        run.__annotations__ = {p.name: p.annotation for p in params}
        return run

    return decorate


_RESERVED = ("ctx", "overrides")
"""Parameters of a decorated command that are not options."""


def _panel_rank(param: inspect.Parameter) -> int:
    """Where --help lists an option's panel: unpanelled options (with --help), the command's
    own panels, then the config's panels in HELP_PANELS order (in a panel, the option table's
    order: the levers' options in the order the levers act)."""
    infos = typing.get_args(param.annotation)[1:]
    panel = getattr(infos[0], "rich_help_panel", None) if infos else None
    if panel is None:
        return 0
    return 2 + HELP_PANELS.index(panel) if panel in HELP_PANELS else 1


__all__ = [
    "CONFIG_FILE",
    "config_fields",
    "config_options",
    "config_parameter",
    "given",
    "given_values",
    "panels",
]
