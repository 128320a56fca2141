"""Options generated from a pydantic model: the model's defaults, its field names, one parser per kind of value."""

from __future__ import annotations

import json
from typing import Literal

import typer
from pydantic import BaseModel, Field
from typer.testing import CliRunner

from eaglenest.cli.options import model_command


class Inner(BaseModel):
    enabled: bool = Field(False, description="switch")
    rate: float = Field(0.5, description="a rate")


class Params(BaseModel):
    name: str = Field(description="required")
    limit: int | None = Field(1000, ge=1, description="None = all")
    ids: list[int] | None = Field(None, description="ids")
    urls: list[str] = Field(default_factory=list, description="repeatable")
    mode: Literal["a", "b"] = Field("a", description="choice")
    inner: Inner = Field(default_factory=Inner, description="nested")


def run(*args: str) -> tuple[int, Params | None, str]:
    app, seen = typer.Typer(), []

    @app.command()
    @model_command(Params, names={"inner.enabled": "--on", "urls": "--url"})
    def cmd(params: Params, loud: bool = False) -> None:
        seen.append((params, loud))

    r = CliRunner().invoke(app, list(args))
    return r.exit_code, (seen[0][0] if seen else None), r.output


def test_defaults_come_from_the_model_and_only_given_fields_are_set():
    code, p, out = run("--name", "x")
    assert code == 0, out
    assert p == Params(name="x") and p.model_fields_set == {"name"}


def test_each_kind_of_value_has_its_parser():
    code, p, out = run("--name", "x", "--limit", "none", "--ids", "1, 14,26", "--url", "u1", "--url", "u2",
                       "--mode", "b", "--on", "--inner-rate", "0.25")
    assert code == 0, out
    assert (p.limit, p.ids, p.urls, p.mode, p.inner) == (None, [1, 14, 26], ["u1", "u2"], "b", Inner(enabled=True,
                                                                                                    rate=0.25))


def test_params_file_is_overridden_by_options(tmp_path):
    f = tmp_path / "p.json"
    f.write_text(json.dumps({"name": "from-file", "limit": 5, "inner": {"rate": 0.1}}))
    code, p, out = run("--params", str(f), "--limit", "7")
    assert code == 0, out
    assert (p.name, p.limit, p.inner.rate) == ("from-file", 7, 0.1)


def test_help_shows_the_models_descriptions_and_defaults():
    code, _, out = run("--help")
    assert code == 0 and "None = all" in out and "1000" in out and "--on" in out and "--no-on" in out
