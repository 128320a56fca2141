"""A server that becomes ready after the run started: preflighted like the first ones, held to the run's pinned
provenance and prompt limit, then handed to the round in progress (connect.admit)."""

from __future__ import annotations

import dataclasses

import pytest

from eaglenest import contract
from eaglenest.engines.preflight import Preflight, PreflightError
from eaglenest.extraction import connect
from eaglenest.extraction.client import ClientConfig
from eaglenest.extraction.validate import Expectation, ValidateConfig

PROV = contract.Provenance(engine="sglang", engine_version="0.5.17", model_path="m", model_hash="m",
                           tokenizer_hash="t", chat_template_hash="c", dtype="bfloat16", aux_layer_ids=(1, 2, 3),
                           hidden_size=8, num_layers=4)


class Ext:
    class params:  # the attributes admit reads
        context_headroom = 1
        engine = "sglang"


class Client:
    def __init__(self) -> None:
        self.added: list[str] = []

    def add_server(self, url: str) -> bool:
        self.added.append(url)
        return True


def ctx(**kw) -> connect.RunContext:
    expect = Expectation(aux_layer_ids=(1, 2, 3), hidden_size=8, num_layers=4, model_hash="m", tokenizer_hash="t",
                         chat_template_hash="c").pinned(PROV)
    return connect.RunContext(pool=None, expect=expect, capture_dirs=("/cap",), max_prompt_tokens=100,
                              client_config=ClientConfig(), validate_config=ValidateConfig(), servers=["http://a"],
                              **kw)


def fake_preflight(monkeypatch, answers):
    calls = []

    def preflight(ext, urls):
        calls.append(urls)
        a = answers.pop(0)
        if isinstance(a, Exception):
            raise a
        return a

    monkeypatch.setattr(connect, "_preflight", preflight)
    return calls


def pf(provenance=PROV, context=2048, dirs=("/cap", "/other")) -> Preflight:
    return Preflight(provenance=provenance, aux_layer_ids=(1, 2, 3), context_length=context, capture_dirs=dirs,
                     servers=())


def test_a_late_server_joins_the_round_in_progress_after_a_transient_refusal(monkeypatch):
    c, client = ctx(), Client()
    c.client = client
    calls = fake_preflight(monkeypatch, [PreflightError("did not answer"), pf()])
    connect.admit(Ext, c, "http://b", pause_s=0)
    assert calls == [["http://b"], ["http://b"]] and client.added == ["http://b"]
    assert c.servers == ["http://a", "http://b"] and c.capture_dirs == ("/cap", "/other")
    c.client = None  # between rounds: the next round's client gets it from ctx.servers
    fake_preflight(monkeypatch, [pf()])
    connect.admit(Ext, c, "http://b", pause_s=0)
    assert c.servers == ["http://a", "http://b"]


@pytest.mark.parametrize(("answer", "match"), [
    (pf(provenance=dataclasses.replace(PROV, model_hash="other")), "serves other numerics"),
    (pf(context=50), "context of 50 tokens"),
])
def test_a_late_server_that_must_not_take_work_is_refused(monkeypatch, answer, match):
    c, client = ctx(), Client()
    c.client = client
    fake_preflight(monkeypatch, [answer])
    with pytest.raises(PreflightError, match=match):
        connect.admit(Ext, c, "http://b", pause_s=0)
    assert client.added == [] and c.servers == ["http://a"]
