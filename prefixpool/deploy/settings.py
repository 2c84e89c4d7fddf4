"""One frozen settings object per process, read from flags and environment in one place.

Every field of a settings dataclass becomes a flag `--field-name` whose default
comes from the environment variable `PREFIXPOOL_FIELD_NAME`, else the field's
default (a boolean flag alone means true; `--flag false` also works). Flags win
over the environment. Knows nothing of what the settings
are for; the component modules declare their own dataclasses.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from typing import Any, TypeVar, get_type_hints

S = TypeVar("S")
ENV_PREFIX = "PREFIXPOOL_"


def flag_name(field: str) -> str:
    return "--" + field.replace("_", "-")


def env_name(field: str) -> str:
    return ENV_PREFIX + field.upper()


def _parse_bool(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off", ""):
        return False
    raise argparse.ArgumentTypeError(f"expected a boolean, got {text!r}")


def _parser_for(annotation: Any):
    if annotation is bool:
        return _parse_bool
    if annotation in (int, float, str):
        return annotation
    args = [a for a in getattr(annotation, "__args__", ()) if a is not type(None)]
    if len(args) == 1 and args[0] in (int, float, str):
        return args[0]
    raise TypeError(f"unsupported settings type {annotation!r}")


def add_flags(parser: argparse.ArgumentParser, cls: type) -> None:
    """Add one flag per field of the settings dataclass `cls`."""
    hints = get_type_hints(cls)
    for field in dataclasses.fields(cls):
        help_text = field.metadata.get("help", "")
        bare = {"nargs": "?", "const": True} if hints[field.name] is bool else {}  # `--flag` alone: true
        parser.add_argument(
            flag_name(field.name), dest=field.name, type=_parser_for(hints[field.name]), default=None,
            help=f"{help_text} (env {env_name(field.name)})", **bare,
        )


class SettingsError(ValueError):
    """Settings that contradict each other or are out of range: the CLI prints the message alone, no traceback."""


def from_args(cls: type[S], args: argparse.Namespace, environ: dict[str, str] | None = None) -> S:
    """Build `cls` from parsed flags, then the environment, then the defaults (SettingsError if they don't fit)."""
    environ = os.environ if environ is None else environ
    hints = get_type_hints(cls)
    values = {}
    for field in dataclasses.fields(cls):
        flag_value = getattr(args, field.name, None)
        if flag_value is not None:
            values[field.name] = flag_value
        elif env_name(field.name) in environ:
            values[field.name] = _parser_for(hints[field.name])(environ[env_name(field.name)])
    try:
        return cls(**values)
    except ValueError as error:
        raise SettingsError(str(error)) from error


def setting(default: Any, help: str) -> Any:  # noqa: A002 - mirrors argparse
    return dataclasses.field(default=default, metadata={"help": help})
