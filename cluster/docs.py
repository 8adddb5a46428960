"""The configuration reference, generated from the settings so that it cannot drift.

`reference()` renders every section and field of `ClusterConfig` (key, type, default,
description) as markdown, `flags_reference()` every `pdserve serve` flag with the YAML key
it is; `pdserve config docs --write` puts them into docs/configuration.md between the
markers below, and a test fails when the file is out of date.
"""

from __future__ import annotations

import types
import typing
from pathlib import Path

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from pdserve.cluster.schema import ClusterConfig
from pdserve.config.fields import flag_of
from pdserve.config.node import NODE_SECTIONS, ServeSettings

BEGIN = "<!-- BEGIN cluster config reference (pdserve config docs --write) -->"
END = "<!-- END cluster config reference -->"
FLAGS_BEGIN = "<!-- BEGIN node flags (pdserve config docs --write) -->"
FLAGS_END = "<!-- END node flags -->"
DOCS_FILE = Path(__file__).resolve().parent.parent / "docs" / "configuration.md"


def _type_name(ann: object) -> str:
    origin = typing.get_origin(ann)
    args = typing.get_args(ann)
    if origin is typing.Literal:
        return " \\| ".join(f"`{a}`" for a in args)
    if origin in (typing.Union, types.UnionType):
        return " \\| ".join(_type_name(a) for a in args)
    if origin in (list, dict):
        return f"{origin.__name__}[{', '.join(_type_name(a) for a in args)}]"
    if isinstance(ann, type):
        if issubclass(ann, BaseModel):
            return "section"
        return {"NoneType": "null", "ByteSize": "bytes"}.get(ann.__name__, ann.__name__)
    return str(ann)


def _section_of(ann: object) -> type[BaseModel] | None:
    for a in (ann, *typing.get_args(ann)):
        if isinstance(a, type) and issubclass(a, BaseModel):
            return a
    return None


def _default(field) -> str:
    if field.default is PydanticUndefined and field.default_factory is None:
        return "required"
    value = field.default_factory() if field.default_factory else field.default
    if isinstance(value, BaseModel):
        return "see below"
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    return f"`{value}`" if value != {} else "`{}`"


def _render(model: type[BaseModel], prefix: str, out: list[str]) -> None:
    doc = " ".join((model.__doc__ or "").split())
    out += [f"### `{prefix or '(top level)'}`", "", doc, ""]
    out += ["| key | type | default | meaning |", "|---|---|---|---|"]
    nested = []
    for name, field in model.model_fields.items():
        key = f"{prefix}.{name}" if prefix else name
        section = _section_of(field.annotation)
        if section is not None:
            nested.append((section, key))
        desc = (field.description or "").replace("|", "\\|")
        out.append(f"| `{key}` | {_type_name(field.annotation)} | {_default(field)} | {desc} |")
    out.append("")
    for section, key in nested:
        _render(section, key, out)


def reference() -> str:
    out: list[str] = []
    _render(ClusterConfig, "", out)
    return "\n".join(out).rstrip() + "\n"


def _flags(cls, name: str, field) -> str:
    flag = flag_of(cls, name)
    names = (
        [f"{flag}`/`--no-{flag[2:]}"] if _type_name(field.annotation).startswith("bool") else [flag]
    )
    extra = field.json_schema_extra if isinstance(field.json_schema_extra, dict) else {}
    return ", ".join(f"`{n}`" for n in names + extra.get("aliases", []))


def flags_reference() -> str:
    """Every `pdserve serve` flag: its YAML key (`-`: set by the launcher per node)."""
    out = ["| flag | YAML key | default | meaning |", "|---|---|---|---|"]
    for cls, path in (*NODE_SECTIONS, (ServeSettings, "")):
        for name, field in cls.model_fields.items():
            key = f"`{path.format(role='GROUP')}.{name}`" if path else "-"
            desc = (field.description or "").replace("|", "\\|")
            out.append(f"| {_flags(cls, name, field)} | {key} | {_default(field)} | {desc} |")
    return "\n".join(out) + "\n"


def _between(text: str, begin: str, end: str, body: str) -> str:
    head, sep, rest = text.partition(begin)
    if not sep:
        raise ValueError(f"{DOCS_FILE} has no '{begin}' marker")
    _, sep, tail = rest.partition(end)
    if not sep:
        raise ValueError(f"{DOCS_FILE} has no '{end}' marker")
    return f"{head}{begin}\n\n{body}\n{end}{tail}"


def updated_text(text: str) -> str:
    """`text` with the generated blocks between the markers replaced."""
    text = _between(text, BEGIN, END, reference())
    return _between(text, FLAGS_BEGIN, FLAGS_END, flags_reference())


def update_docs_file(path: Path = DOCS_FILE) -> bool:
    """Rewrite the generated block; True when the file changed."""
    text = path.read_text()
    new = updated_text(text)
    if new != text:
        path.write_text(new)
    return new != text
