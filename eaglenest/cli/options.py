"""Command-line options generated from the pydantic models: the models are the one home of every default.

Owns how a config model becomes a command: :func:`model_command` turns a function ``f(params, **extra)`` into
a typer command whose options are the model's fields (name, type, default and help text taken from the
field), plus ``--params FILE`` (a JSON file of field values, e.g. a saved config). Values given on the command
line override the file; fields not given keep the model's default (the model, not the CLI, decides it), so
``model_fields_set`` says what the user chose. Nested models (``regeneration``) become prefixed options.

One parser per kind of value: integer lists (``--aux-layers 1,14,26``) go through :func:`parse_ids`,
optional numbers take ``none`` (:func:`parse_optional`), repeatable strings are repeated options and
``Literal`` fields are choices.
"""

from __future__ import annotations

import functools
import inspect
import json
import types
import typing
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Annotated, Any, Literal, get_args, get_origin

import typer
from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from eaglenest.cli.errors import UsageError, one_line


def parse_ids(text: str | None) -> list[int] | None:
    """``1,14,26`` -> [1, 14, 26] (None when empty); a bad list is a usage error naming it."""
    if text is None or not str(text).strip():
        return None
    try:
        return [int(x) for x in str(text).replace(" ", "").split(",") if x]
    except ValueError:
        raise UsageError(f"expected comma-separated integers, got {text!r}") from None


def parse_optional(kind: type) -> Callable[[str | None], Any]:
    """A number or ``none`` (unset: the model's None, e.g. ``--limit none`` reads the whole source)."""

    def parse(text: str | None) -> Any:
        if text is None or str(text).strip().lower() in ("none", "null", ""):
            return None
        try:
            return kind(text)
        except ValueError:
            raise UsageError(f"expected {'an integer' if kind is int else 'a number'} or 'none', "
                             f"got {text!r}") from None

    return parse


def _unwrap_optional(annotation: Any) -> tuple[Any, bool]:
    if get_origin(annotation) in (typing.Union, types.UnionType):
        args = [a for a in get_args(annotation) if a is not type(None)]
        if len(args) == 1 and len(args) < len(get_args(annotation)):
            return args[0], True
    return annotation, False


def _default(field: Any) -> Any:
    if field.default_factory is not None:
        return field.default_factory()
    return None if field.default is PydanticUndefined else field.default


class _Field:
    """One generated option: the model path it fills, its python name, and how its value is converted."""

    def __init__(self, path: tuple[str, ...], param: inspect.Parameter, convert: Callable[[Any], Any]) -> None:
        self.path, self.param, self.convert = path, param, convert


def _option(path: tuple[str, ...], field: Any, names: Mapping[str, str]) -> _Field:
    dotted = ".".join(path)
    flag = names.get(dotted) or "--" + "-".join(path).replace("_", "-")
    pyname = "__".join(path)
    base, optional = _unwrap_optional(field.annotation)
    default = _default(field)
    required = field.is_required()
    kw: dict[str, Any] = {"help": field.description or ""}
    convert: Callable[[Any], Any] = lambda v: v  # noqa: E731
    if get_origin(base) is Literal:
        annotation: Any = base | None if optional else base
    elif get_origin(base) is list and get_args(base) == (int,):
        annotation = str | None
        convert = parse_ids
        default = ",".join(str(i) for i in default) if default else None
        kw["metavar"] = "INT,INT,..."
    elif get_origin(base) is list:
        annotation = list[str] | None
        convert = lambda v: list(v or [])  # noqa: E731
        default = None
    elif base is bool:
        annotation = bool
        if flag.startswith("--") and "/" not in flag:
            flag = f"{flag}/--no-{flag[2:]}"
    elif optional and base in (int, float):
        annotation, convert = str | None, parse_optional(base)
        default = None if default is None else str(default)
        kw["metavar"] = f"{'INT' if base is int else 'FLOAT'}|none"
    elif base in (int, float, str, Path):
        annotation = base | None if optional else base
    else:
        raise TypeError(f"{dotted}: no command-line form for {field.annotation!r}")
    if required:  # may come from --params; the model names it when it is missing
        annotation, default = annotation | None, None
        kw["help"] = f"{kw['help']} (required)".strip()
    param = inspect.Parameter(pyname, inspect.Parameter.KEYWORD_ONLY, default=default,
                              annotation=Annotated[annotation, typer.Option(flag, **kw)])
    return _Field(path, param, convert)


def model_fields_as_options(model: type[BaseModel], names: Mapping[str, str] = {}, skip: frozenset[str] = frozenset(),
                            prefix: tuple[str, ...] = ()) -> list[_Field]:
    out = []
    for name, field in model.model_fields.items():
        path = (*prefix, name)
        if ".".join(path) in skip:
            continue
        base, _ = _unwrap_optional(field.annotation)
        if isinstance(base, type) and issubclass(base, BaseModel):
            out += model_fields_as_options(base, names, skip, path)
        else:
            out.append(_option(path, field, names))
    return out


def read_params_file(path: Path | None) -> dict:
    """A JSON object of field values; a missing or malformed file is a usage error naming it."""
    if path is None:
        return {}
    try:
        data = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise UsageError(f"--params {path}: no such file") from None
    except (OSError, ValueError) as e:
        raise UsageError(f"--params {path}: not a JSON file ({e})") from None
    if not isinstance(data, dict):
        raise UsageError(f"--params {path}: must hold a JSON object of fields")
    return data


def _set_path(data: dict, path: tuple[str, ...], value: Any) -> None:
    for key in path[:-1]:
        data = data.setdefault(key, {})
    data[path[-1]] = value


def model_command(model: type[BaseModel], *, names: Mapping[str, str] = {}, skip: frozenset[str] = frozenset(),
                  only: frozenset[str] | None = None, extra: Callable[[dict], dict] | None = None) -> Callable:
    """Decorate ``f(params: model, **rest)``: the command gets one option per model field (``only`` those, or
    all but ``skip``), ``--params FILE`` and ``f``'s own remaining parameters. ``extra(rest)`` may add field
    values computed from ``f``'s own options (e.g. ``--set FIELD=VALUE``); they override the file, and
    command-line fields override both. Required fields are options too (they may come from the file); a
    missing one is the model's own error naming it."""

    if only is not None:
        skip = frozenset(n for n in model.model_fields if n not in only)
    fields = model_fields_as_options(model, names, skip)

    def decorate(f: Callable) -> Callable:
        own = [p for p in inspect.signature(f, eval_str=True).parameters.values() if p.name != "params"]
        params_file = inspect.Parameter(
            "params_file", inspect.Parameter.KEYWORD_ONLY, default=None,
            annotation=Annotated[Path | None, typer.Option("--params", help=(
                f"JSON file of {model.__name__} fields (options given here override it)"))])
        ctx_param = inspect.Parameter("ctx", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=typer.Context)
        own_names = {p.name for p in own}

        @functools.wraps(f)
        @one_line
        def command(ctx: typer.Context, **kw: Any) -> Any:
            data = read_params_file(kw.pop("params_file", None))
            rest = {k: kw.pop(k) for k in list(kw) if k in own_names}
            if extra is not None:
                data.update(extra(rest))
            for fld in fields:
                value = kw.pop(fld.param.name)
                source = ctx.get_parameter_source(fld.param.name)
                if source is not None and source.name != "DEFAULT":  # given by the user, not the model's default
                    _set_path(data, fld.path, fld.convert(value))
            return f(model.model_validate(data), **rest)

        sig = [ctx_param, *[p.replace(kind=inspect.Parameter.KEYWORD_ONLY) for p in own], params_file,
               *[fld.param for fld in fields]]
        sig = sorted(sig, key=lambda p: p.kind)  # the context first, then keyword-only options
        command.__signature__ = inspect.Signature(sig)
        command.__annotations__ = {p.name: p.annotation for p in sig}
        del command.__wrapped__
        return command

    return decorate
