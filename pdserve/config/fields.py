"""The base of every settings class, and the `pdserve` flags generated from its fields.

A field is written once: its name (the YAML key, the engine's attribute and, with dashes,
the flag), its type and default, its checks (pydantic constraints and validators) and its
help text (`description`, which docs/configuration.md and `--help` both show).

A class may give its flags a common prefix (`FLAG_PREFIX = "kv-"`: the transfer settings'
`peer_timeout_s` is `--kv-peer-timeout-s`); a field may name its flag outright (`flag=`,
e.g. the model's `name` is `--model`) and keep older spellings working (`aliases=`).
"""

from __future__ import annotations

import argparse
import types
import typing
from typing import Any, ClassVar

from pydantic import BaseModel, ByteSize, ConfigDict, Field, TypeAdapter, ValidationError

from pdserve.common.errors import ConfigError  # one type for settings and engine checks


class Settings(BaseModel):
    """Frozen; unknown keys are errors, so a typo never passes silently."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    FLAG_PREFIX: ClassVar[str] = ""


def setting(default: Any = ..., help: str = "", *, flag: str | None = None,
            aliases: tuple[str, ...] = (), metavar: str | None = None,
            **checks: Any) -> Any:  # fmt: skip
    """A field: default, help text, pydantic checks (`ge=1`, ...), and its flag's spelling."""
    pairs = (("flag", flag), ("aliases", list(aliases)), ("metavar", metavar))
    extra = {k: v for k, v in pairs if v}
    return Field(default, description=help, json_schema_extra=extra or None, **checks)


def _first(e: ValidationError) -> tuple[str, str]:
    """(the field, the message) of the first error, without pydantic's "Value error, "."""
    err = e.errors()[0]
    loc = str(err["loc"][0]) if err["loc"] else ""
    return loc, err["msg"].removeprefix("Value error, ")


# -- flags ---------------------------------------------------------------------------


def _extra(cls: type[Settings], name: str) -> dict:
    extra = cls.model_fields[name].json_schema_extra
    return extra if isinstance(extra, dict) else {}


def flag_of(cls: type[Settings], name: str) -> str:
    """The field's `pdserve` flag, e.g. `--kv-peer-timeout-s`."""
    return _extra(cls, name).get("flag") or f"--{cls.FLAG_PREFIX}{name.replace('_', '-')}"


def dest_of(cls: type[Settings], name: str) -> str:
    """The argparse dest of the field's flag (`kv_peer_timeout_s`)."""
    return flag_of(cls, name)[2:].replace("-", "_")


def _scalar(ann: Any) -> tuple[Any, bool]:
    """(the type a flag parses, whether it repeats) for a field annotation."""
    origin, args = typing.get_origin(ann), typing.get_args(ann)
    if origin in (typing.Union, types.UnionType):
        return _scalar(next(a for a in args if a is not type(None)))
    if origin in (list, tuple):
        return _scalar(args[0])[0], True
    return ann, False


def _parser(kind: Any):
    if kind is ByteSize:  # `--kv-cache-bytes 256MiB` as in YAML (plain integers too)
        adapter = TypeAdapter(ByteSize)
        return lambda s: int(adapter.validate_python(s))
    return kind


def add_flags(parser: argparse._ActionsContainer, cls: type[Settings]) -> None:
    """One flag per field of `cls` (bools as `--x/--no-x`, lists repeatable)."""
    for name, field in cls.model_fields.items():
        kind, repeats = _scalar(field.annotation)
        dest, aliases = dest_of(cls, name), _extra(cls, name).get("aliases", [])
        kw: dict[str, Any] = {"dest": dest, "help": field.description or None}
        kw["default"] = field.default_factory() if field.default_factory else field.default
        if kind is bool:
            parser.add_argument(flag_of(cls, name), action=argparse.BooleanOptionalAction, **kw)
            for alias in aliases:  # `--no-prefix-caching`: an older spelling of --no-...
                off = alias.startswith("--no-")
                parser.add_argument(
                    alias,
                    action="store_false" if off else "store_true",
                    dest=dest,
                    default=kw["default"],
                    help=argparse.SUPPRESS,
                )
            continue
        if typing.get_origin(kind) is typing.Literal:
            kw["choices"] = list(typing.get_args(kind))
        else:
            kw["type"] = _parser(kind)
        if repeats:
            kw.update(action="append", default=[])
        if "metavar" in _extra(cls, name):
            kw["metavar"] = _extra(cls, name)["metavar"]
        parser.add_argument(flag_of(cls, name), *aliases, **kw)


def from_args(cls: type[Settings], args: argparse.Namespace) -> Settings:
    """The settings `cls` holds in parsed flags, checked by the class itself (an invalid
    value raises ConfigError naming its flag's dest, e.g. `kv_peer_timeout_s`)."""
    values = {name: getattr(args, dest_of(cls, name)) for name in cls.model_fields}
    try:
        return cls(**values)
    except ValidationError as e:
        loc, msg = _first(e)
        raise ConfigError(dest_of(cls, loc) if loc else cls.__name__, msg) from None


def to_dests(cls: type[Settings], values: BaseModel) -> dict[str, Any]:
    """`values`' fields of `cls`, keyed by flag dest (a node's settings from YAML)."""
    out = {}
    for name in cls.model_fields:
        value = getattr(values, name)
        out[dest_of(cls, name)] = int(value) if isinstance(value, ByteSize) else value
    return out


# -- the engine's configs: defaults and checks from the same fields ------------------


def default(cls: type[Settings], name: str) -> Any:
    """The field's default (an engine config's field defaults to its setting's)."""
    return cls.model_fields[name].get_default(call_default_factory=True)


def check(where: str, obj: Any, *classes: type[Settings], skip: tuple[str, ...] = ()) -> None:
    """Check the fields `obj` (an engine config) shares by name with `classes` as those
    classes check them; ConfigError names `where.field` (`field` when `where` is "")."""
    for cls in classes:
        given = {n: getattr(obj, n) for n in cls.model_fields if hasattr(obj, n) and n not in skip}
        try:
            cls.model_validate(given)
        except ValidationError as e:
            loc, msg = _first(e)
            raise ConfigError(f"{where}.{loc}" if where else loc, msg) from None
