"""A service's command line, generated from its settings class (llama-server's style): one
flag per field, named after it (`max_batch_size` -> `--max-batch-size`), whose help is the
field's description, its default and its environment variable. Booleans take
`--flag` / `--no-flag`; lists take the environment's comma-separated form.

Flags override the environment (they are the settings' constructor arguments, which
pydantic-settings ranks above it). An unknown flag or a bad value, from a flag or from the
environment, exits 2 with one line naming it.

pydantic-settings' own CLI source (2.16) makes a flag of every validation alias
(`--ASYMSPEC-COLOCATED`) and cannot show the environment variable, hence this small one.
"""

from __future__ import annotations

import argparse
import enum
import inspect
import sys
import typing
from collections.abc import Sequence
from typing import Any, NoReturn, TypeVar

from pydantic import AliasChoices, ValidationError
from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings

S = TypeVar("S", bound=BaseSettings)


class OneLineParser(argparse.ArgumentParser):
    """argparse, but an error is one line (no usage block) and exits 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


def flag_name(field: str) -> str:
    return "--" + field.replace("_", "-")


def env_name(settings_cls: type[BaseSettings], field: str) -> str:
    """The environment variable a field is read from: its upper-case validation alias
    (a variable shared by both services, ASYMSPEC_MODE) or the class's prefix + its name."""
    alias = settings_cls.model_fields[field].validation_alias
    choices = alias.choices if isinstance(alias, AliasChoices) else [alias]
    for choice in choices:
        if isinstance(choice, str) and choice.isupper():
            return choice
    prefix = str(settings_cls.model_config.get("env_prefix", ""))
    return (prefix + field).upper()


def help_line(settings_cls: type[BaseSettings], field: str) -> str:
    info = settings_cls.model_fields[field]
    if info.is_required():
        default = "required"
    else:
        value = info.get_default(call_default_factory=True)
        if isinstance(value, bool):
            value = str(value).lower()
        elif isinstance(value, enum.Enum):
            value = value.value
        elif isinstance(value, tuple | list | frozenset):
            value = ",".join(map(str, sorted(value) if isinstance(value, frozenset) else value))
        default = f"default: {value if value not in ('', None) else 'unset'}"
    # argparse treats % as a format character in help strings
    description = (info.description or "").replace("%", "%%")
    return f"{description} ({default}; env: {env_name(settings_cls, field)})"


def choices_of(info: FieldInfo) -> list[str] | None:
    annotation = info.annotation
    if typing.get_origin(annotation) is typing.Literal:
        return [str(a) for a in typing.get_args(annotation)]
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        return [str(member.value) for member in annotation]
    return None


def metavar_of(info: FieldInfo) -> str:
    annotation = info.annotation
    args = typing.get_args(annotation)
    if typing.get_origin(annotation) in (tuple, frozenset, list, set):
        return "A,B,..."
    if annotation is int or int in args:
        return "N"
    if annotation is float:
        return "X"
    return "TEXT"


def defining_class(settings_cls: type[BaseSettings], field: str) -> type:
    """The class of the hierarchy furthest from BaseSettings that annotates the field."""
    for cls in settings_cls.__mro__:
        if field in inspect.get_annotations(cls):
            return cls
    return settings_cls


def shadowed_fields(settings_cls: type[BaseSettings]) -> set[str]:
    """Fields that read the same variable as a field declared after them (the edge's own
    ``mode`` and the shared base's ``colocated_mode`` both read ASYMSPEC_MODE): the later,
    the service's own, gets the flag."""
    fields = list(settings_cls.model_fields)
    return {
        field
        for i, field in enumerate(fields)
        if any(env_name(settings_cls, field) == env_name(settings_cls, f) for f in fields[i + 1 :])
    }


def build_parser(settings_cls: type[BaseSettings], prog: str) -> OneLineParser:
    """Flags grouped by the class that declares them: the service's own first."""
    parser = OneLineParser(
        prog=prog,
        usage="%(prog)s [options]",
        description="Settings come from these flags, else the environment, else the defaults.",
        argument_default=argparse.SUPPRESS,  # an absent flag leaves the environment's value
    )
    owners = [defining_class(settings_cls, field) for field in settings_cls.model_fields]
    groups = {
        cls: parser.add_argument_group(f"{cls.__name__} options")
        for cls in settings_cls.__mro__
        if cls in owners
    }
    for field, info in settings_cls.model_fields.items():
        if field in shadowed_fields(settings_cls):
            continue
        group = groups[defining_class(settings_cls, field)]
        help_text = help_line(settings_cls, field)
        if info.annotation is bool:
            group.add_argument(
                flag_name(field), dest=field, action=argparse.BooleanOptionalAction, help=help_text
            )
        elif (choices := choices_of(info)) is not None:
            group.add_argument(flag_name(field), dest=field, choices=choices, help=help_text)
        else:
            group.add_argument(
                flag_name(field), dest=field, metavar=metavar_of(info), help=help_text
            )
    return parser


def settings_error(settings_cls: type[BaseSettings], exc: ValidationError) -> str:
    """One line naming each bad setting by its flag and its environment variable."""
    problems = []
    for error in exc.errors():
        loc = [str(part) for part in error["loc"]]
        field = field_at(settings_cls, loc[0]) if loc else None
        name = f"{flag_name(field)} ({env_name(settings_cls, field)})" if field else ".".join(loc)
        problems.append(f"{name}: {error['msg']}")
    return "bad settings: " + "; ".join(problems)


def field_at(settings_cls: type[BaseSettings], key: str) -> str | None:
    """The field an error location names: the field itself, or one of its aliases (two
    fields may share a variable: the service's own, declared last, is the one checked)."""
    for field, info in reversed(settings_cls.model_fields.items()):
        alias = info.validation_alias
        aliases = alias.choices if isinstance(alias, AliasChoices) else [alias]
        if key.lower() in {field, env_name(settings_cls, field).lower()} | {
            str(a).lower() for a in aliases if a
        }:
            return field
    return None


def parse_settings(settings_cls: type[S], prog: str, argv: Sequence[str] | None = None) -> S:
    """The settings from the command line over the environment; exit 2 when they are wrong."""
    parser = build_parser(settings_cls, prog)
    flags: dict[str, Any] = vars(parser.parse_args(sys.argv[1:] if argv is None else argv))
    try:
        return settings_cls(**flags)
    except ValidationError as exc:
        parser.error(settings_error(settings_cls, exc))
