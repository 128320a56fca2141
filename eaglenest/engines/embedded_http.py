"""The embedded capture server's HTTP layer: SGLang's native endpoints over an :class:`EmbeddedEngine`.

``/health``, ``/get_model_info`` (+ ``/model_info``), ``/get_server_info`` (+ ``/server_info``) and ``POST
/generate``; :func:`parse_generate` turns a request body into the engine's work items (every field checked and
named in the 400), and each answer carries SGLang's ``meta_info`` (``capture`` when a shard was written, the
``spec_*`` counts when the greedy decoder speculated). The engine (:mod:`eaglenest.engines.embedded`) owns the
scheduling, the capture and the error statuses.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
import uuid
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from eaglenest import contract
from eaglenest.engines import ENV_FAULTS
from eaglenest.engines.embedded import EmbeddedEngine, RequestError, Work
from eaglenest.engines.pool import ENV_LAUNCH_TOKEN
from eaglenest.engines.runtime import Generation

log = logging.getLogger(__name__)


def _as_list(value: Any, n: int, name: str) -> list[Any]:
    if isinstance(value, list):
        if len(value) != n:
            raise RequestError(400, f"{name} has {len(value)} entries for {n} prompts")
        return value
    return [value] * n


def parse_generate(body: Any, engine: EmbeddedEngine) -> tuple[list[Work], bool]:
    """Validate a /generate body into work items; returns (works, batched)."""
    if not isinstance(body, dict):
        raise RequestError(400, "request body must be a JSON object")
    ids, text = body.get("input_ids"), body.get("text")
    if (ids is None) == (text is None):
        raise RequestError(400, "give exactly one of input_ids or text")
    if ids is not None:
        batched = bool(ids) and isinstance(ids[0], list) if isinstance(ids, list) else False
        prompts = ids if batched else [ids]
        for p in prompts:
            if not isinstance(p, list) or not p or not all(isinstance(t, int) and not isinstance(t, bool)
                                                           for t in p):
                raise RequestError(400, "input_ids must be a non-empty list of integers (or a list of them)")
    else:
        batched = isinstance(text, list)
        texts = text if batched else [text]
        if not texts or not all(isinstance(t, str) and t for t in texts):
            raise RequestError(400, "text must be a non-empty string (or a list of them)")
        prompts = [engine.runner.tokenizer(t)["input_ids"] for t in texts]
    n = len(prompts)
    rids = _as_list(body.get("rid"), n, "rid")
    params = _as_list(body.get("sampling_params") or {}, n, "sampling_params")
    vocab = engine.runner.model.config.vocab_size
    ctx = engine.runner.context_length
    works = []
    for prompt, rid, sp in zip(prompts, rids, params, strict=True):
        if rid is None:
            rid = uuid.uuid4().hex
        if not isinstance(rid, str) or not rid:
            raise RequestError(400, "rid must be a non-empty string")
        if not isinstance(sp, dict):
            raise RequestError(400, "sampling_params must be an object")
        try:
            contract.shard_filename(rid)
        except contract.ContractError as e:
            raise RequestError(400, f"rid: {e}") from None
        bad = [t for t in prompt if t < 0 or t >= vocab]
        if bad:
            raise RequestError(400, f"input_ids: token id {bad[0]} outside the vocabulary [0, {vocab})")
        max_new = sp.get("max_new_tokens", 128)
        if not isinstance(max_new, int) or max_new < 0:
            raise RequestError(400, "sampling_params.max_new_tokens must be an integer >= 0")
        if ctx and len(prompt) + max_new > ctx:
            raise RequestError(
                413, f"prompt of {len(prompt)} tokens + {max_new} new exceeds the context length {ctx}",
                "context_exceeded",
            )
        try:
            temperature = float(sp.get("temperature", 1.0))
            top_p = float(sp.get("top_p", 1.0))
        except (TypeError, ValueError):
            raise RequestError(400, "sampling_params.temperature and top_p must be numbers") from None
        works.append(Work(
            rid=rid, input_ids=list(prompt), max_new_tokens=max_new, temperature=temperature, top_p=top_p,
            ignore_eos=bool(sp.get("ignore_eos", False)), seed=sp.get("sampling_seed", sp.get("seed")),
            capture=engine.capture_dir is not None and not rid.startswith(contract.NO_CAPTURE_RID_PREFIX),
        ))
    return works, batched


def _response(engine: EmbeddedEngine, w: Work, result: Generation, shard: dict | None) -> dict[str, Any]:
    meta: dict[str, Any] = {
        "id": w.rid,
        "prompt_tokens": len(w.input_ids),
        "completion_tokens": len(result.output_ids),
        "cached_tokens": 0,
        "finish_reason": {"type": result.finish_reason, "length": len(result.output_ids)}
        if result.finish_reason == "length" else {"type": "stop", "matched": result.output_ids[-1]},
        "e2e_latency": time.perf_counter() - w.t_arrival,
    }
    if shard is not None:
        meta["capture"] = shard
    if result.spec_verify_ct:  # SGLang's names: accept length = completion_tokens / verify_ct (bonus counted)
        meta.update(spec_verify_ct=result.spec_verify_ct, spec_num_correct_drafts=result.spec_correct_drafts,
                    spec_num_proposed_drafts=result.spec_proposed_drafts,
                    spec_accept_length=len(result.output_ids) / result.spec_verify_ct,
                    spec_accept_rate=result.spec_correct_drafts / max(result.spec_proposed_drafts, 1))
    text = engine.runner.tokenizer.decode(result.output_ids, skip_special_tokens=True)
    return {"text": text, "output_ids": result.output_ids, "meta_info": meta}


def _error(e: RequestError) -> JSONResponse:
    return JSONResponse({"error": {"message": e.message, "type": e.kind, "code": e.status}}, status_code=e.status)


def create_app(engine: EmbeddedEngine) -> FastAPI:
    """The HTTP app. Setting ``EAGLENEST_FAULTS`` opts in to fault injection (eaglenest.testing.faults)."""
    app = FastAPI(title="eaglenest embedded capture server")
    if os.environ.get(ENV_FAULTS, "").strip():
        from eaglenest.testing.faults import FaultMiddleware, Faults

        faults = Faults.from_env()
        log.warning("fault injection on: %s", faults)
        app.add_middleware(FaultMiddleware, faults=faults)

    @app.get("/health")
    async def health():
        return JSONResponse({"status": "ok"})

    @app.get("/get_model_info")
    @app.get("/model_info")
    async def model_info():
        return engine.model_info()

    @app.get("/get_server_info")
    @app.get("/server_info")
    async def server_info():
        from eaglenest import __version__

        info = {"version": __version__, "engine": "embedded", "stats": dict(engine.stats),
                "context_length": engine.runner.context_length, "dtype": engine.runner.dtype_name,
                "max_batch_size": engine.settings.max_batch_size,
                "launch_token": os.environ.get(ENV_LAUNCH_TOKEN)}  # lets a launcher tell its server from a leftover
        if engine.greedy_decoder is not None and hasattr(engine.greedy_decoder, "server_info"):
            info.update(engine.greedy_decoder.server_info(engine.stats))  # speculative_* like SGLang's
        return info

    @app.post("/generate")
    async def generate(request: Request):
        try:
            body = await request.json()
        except Exception:
            return _error(RequestError(400, "request body is not valid JSON"))
        try:
            works, batched = parse_generate(body, engine)
            futures = [asyncio.wrap_future(engine.submit(w)) for w in works]
            results = await asyncio.gather(*futures)
        except RequestError as e:
            return _error(e)
        answers = [_response(engine, w, res, shard) for w, (res, shard) in zip(works, results, strict=True)]
        return answers if batched else answers[0]

    return app
