"""Load a cluster config file: YAML -> `ClusterConfig`, every error naming field and line.

`load_config(path, overrides)` parses the YAML while recording the line of every key,
applies `--set a.b=value` overrides, validates with the pydantic schema, then runs the
checks that span fields (cluster/checks.py). Any problem raises one `ConfigFileError`
listing each issue as `FILE:LINE: field.path: message`, before anything is started.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from pdserve.cluster.schema import ClusterConfig

Path_ = tuple[str | int, ...]


@dataclass(frozen=True)
class Issue:
    field: str  # dotted path, e.g. "prefill.connector"
    where: str  # "configs/local.yaml:12" or "--set router.port=1"
    message: str

    def __str__(self) -> str:
        return f"{self.where}: {self.field}: {self.message}"


class ConfigFileError(ValueError):
    """The config file is invalid; `issues` name each field and where it was written."""

    def __init__(self, issues: list[Issue]):
        self.issues = issues
        super().__init__("\n".join(str(i) for i in issues))

    @property
    def field(self) -> str:
        return self.issues[0].field


@dataclass
class Source:
    """The raw data of a config and where each key came from (for error messages)."""

    file: str
    data: Any
    origins: dict[Path_, str]  # key path -> "FILE:LINE" or "--set ..."

    def where(self, path: Path_) -> str:
        """Origin of the longest prefix of `path` that was written (the file if none)."""
        for n in range(len(path), 0, -1):
            if path[:n] in self.origins:
                return self.origins[path[:n]]
        return self.origins.get((), f"{self.file}:1")

    def issue(self, path: Path_, message: str) -> Issue:
        return Issue(dotted(path), self.where(path), message)


def dotted(path: Path_) -> str:
    return "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in path).lstrip(".")


def _walk(node: yaml.Node, path: Path_, file: str, origins: dict, issues: list) -> None:
    if isinstance(node, yaml.MappingNode):
        seen = set()
        for key_node, value_node in node.value:
            key = key_node.value
            where = f"{file}:{key_node.start_mark.line + 1}"
            if key in seen:
                issues.append(Issue(dotted((*path, key)), where, "duplicate key"))
            seen.add(key)
            origins[(*path, key)] = where
            _walk(value_node, (*path, key), file, origins, issues)
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            origins[(*path, i)] = f"{file}:{item.start_mark.line + 1}"
            _walk(item, (*path, i), file, origins, issues)


def parse_yaml(text: str, file: str) -> Source:
    try:
        data = yaml.safe_load(text)
        root = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"{file}:{mark.line + 1}" if mark else file
        raise ConfigFileError([Issue("(yaml)", where, f"not valid YAML: {e}")]) from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigFileError([Issue("(root)", f"{file}:1", "must be a mapping of sections")])
    origins: dict[Path_, str] = {(): f"{file}:1"}
    issues: list[Issue] = []
    if root is not None:
        _walk(root, (), file, origins, issues)
    if issues:
        raise ConfigFileError(issues)
    return Source(file, data, origins)


def apply_override(source: Source, item: str) -> None:
    """`a.b.c=value` (value parsed as YAML) replaces or adds that key."""
    key, sep, raw = item.partition("=")
    if not sep or not key:
        raise ConfigFileError([Issue(key or item, f"--set {item}", "expected KEY.PATH=VALUE")])
    path = tuple(key.split("."))
    node = source.data
    for part in path[:-1]:
        if not isinstance(node.get(part), dict):
            node[part] = {} if node.get(part) is None else node[part]
        if not isinstance(node[part], dict):
            raise ConfigFileError([Issue(key, f"--set {item}", f"{part} is not a section")])
        node = node[part]
    node[path[-1]] = yaml.safe_load(raw) if raw else None
    for p in [p for p in source.origins if p[: len(path)] == path]:
        del source.origins[p]
    source.origins[path] = f"--set {item}"


def _section_at(path: Path_) -> type[BaseModel] | None:
    """The schema model that holds the keys at `path` (for unknown-key hints)."""
    model: type[BaseModel] | None = ClusterConfig
    for part in path:
        field = model.model_fields.get(part) if model else None
        if field is None:
            return None
        ann = field.annotation
        candidates = getattr(ann, "__args__", (ann,))
        model = next(
            (c for c in candidates if isinstance(c, type) and issubclass(c, BaseModel)), None
        )
    return model


def _validation_issues(source: Source, err: ValidationError) -> list[Issue]:
    issues: dict[str, Issue] = {}
    for e in err.errors():
        # Keep the part of `loc` that names real keys: union member tags ("int",
        # "list[int]") are dropped; a missing key is kept as the last element.
        path: list[str | int] = []
        data = source.data
        for part in e["loc"]:
            if isinstance(data, dict) and part in data:
                data = data[part]
            elif isinstance(data, list) and isinstance(part, int) and part < len(data):
                data = data[part]
            elif e["type"] == "missing" and isinstance(data, dict):
                path.append(part)
                break
            else:
                break
            path.append(part)
        message = e["msg"]
        if e["type"] == "missing":
            message = "required but missing"
        elif e["type"] == "extra_forbidden":
            section = _section_at(tuple(path[:-1]))
            allowed = sorted(section.model_fields) if section else []
            close = difflib.get_close_matches(str(path[-1]), allowed, n=1)
            message = f"unknown key (did you mean {close[0]!r}?)" if close else "unknown key"
            if allowed:
                message += f"; allowed here: {', '.join(allowed)}"
        issue = source.issue(tuple(path), message)
        issues.setdefault(issue.field, issue)
    return list(issues.values())


def load_source(source: Source) -> ClusterConfig:
    from pdserve.cluster.checks import cross_checks

    try:
        cfg = ClusterConfig.model_validate(source.data)
    except ValidationError as e:
        raise ConfigFileError(_validation_issues(source, e)) from None
    problems = cross_checks(cfg)
    if problems:
        raise ConfigFileError([source.issue(path, msg) for path, msg in problems])
    return cfg


def load_config(path: str | Path, overrides: list[str] = ()) -> ClusterConfig:
    """Read, override, validate: a valid `ClusterConfig` or a `ConfigFileError`."""
    file = str(path)
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise ConfigFileError([Issue("(file)", file, f"cannot read: {e.strerror}")]) from None
    source = parse_yaml(text, file)
    if isinstance(source.data.get("redis"), str):  # `redis: URL` is short for {url: URL}
        source.data["redis"] = {"url": source.data["redis"]}
        source.origins[("redis", "url")] = source.where(("redis",))
    for item in overrides:
        apply_override(source, item)
    return load_source(source)
