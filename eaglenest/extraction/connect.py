"""Connecting an extraction to its servers: launch specs, the pool, and the preflight that pins what every
shard must carry.

Owns :class:`RunContext` (what the run learned from its servers, shared by the loop's steps, never
serialized), :func:`make_pool` (given URLs or launched servers recorded in ``servers.json``) and
:func:`connect` (preflight every server against the run and the extraction's pinned provenance).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import httpx
import torch

from eaglenest import contract
from eaglenest.atomic import atomic_write_bytes
from eaglenest.data.chat import ChatEncoder
from eaglenest.engines.preflight import Preflight, PreflightError, preflight
from eaglenest.engines.server_pool import LaunchSpec, ServerPool
from eaglenest.extraction.checking import default_check_processes
from eaglenest.extraction.client import ClientConfig, EngineClient
from eaglenest.extraction.lm_head import load_lm_head
from eaglenest.extraction.prefill import CAPTURE_LANE
from eaglenest.extraction.regenerate import RegenConfig
from eaglenest.extraction.state import ConfigChanged, Extraction
from eaglenest.extraction.validate import Expectation, ValidateConfig


@dataclass
class RunContext:
    """What a run learned from its servers, shared by its steps (in-process, never serialized)."""

    pool: ServerPool
    expect: Expectation
    capture_dirs: tuple[str, ...]
    max_prompt_tokens: int
    client_config: ClientConfig
    validate_config: ValidateConfig
    transport: httpx.AsyncBaseTransport | None = None
    encoder: ChatEncoder | None = None
    lm_head: torch.Tensor | None = None
    regen_config: RegenConfig | None = None
    servers: list[str] = field(default_factory=list)
    """The servers that passed the preflight (the first ones, then each late joiner): each round's client."""
    client: EngineClient | None = None
    """The round in progress's client (None between rounds): a server that joins late is handed to it."""
    lock: threading.Lock = field(default_factory=threading.Lock)
    """Guards ``servers`` and ``client`` (a late server is admitted on a launch thread)."""


# ------------------------------------------------------------------------------ servers
def launch_specs(ext: Extraction) -> list[LaunchSpec]:
    """How to start each of ``num_servers`` servers for this extraction (embedded or sglang)."""
    from eaglenest.engines.pool import ServerProcess, embedded_command, local_server
    from eaglenest.engines.sglang_flags import sglang_decode_batch_flags, sglang_placements, visible_gpus

    p = ext.params
    # computed once, before any server starts: a placement that cannot work is refused here (LaunchError)
    placements = (sglang_placements(p.sglang_args, num_servers=p.num_servers, gpus=visible_gpus())
                  if p.engine == "sglang" else [])

    def embedded(i: int) -> LaunchSpec:
        def make(port: int) -> ServerProcess:
            cmd = embedded_command(model=str(ext.model_dir), port=port, capture_dir=str(ext.capture_dir),
                                   aux_layer_ids=ext.aux_layer_ids, dtype=p.dtype,
                                   extra=["--max-batch-size", str(p.embedded_max_batch_size)])
            return local_server(cmd, port=port, log_path=ext.path(f"logs/server-{i}.log"))
        return LaunchSpec(f"embedded-{i}", make)

    def sglang(i: int) -> LaunchSpec:
        place = placements[i]

        def make(port: int) -> ServerProcess:
            from eaglenest.engines import sglang_launcher

            args = list(p.sglang_args)
            if p.regeneration.enabled:  # decoding dominates: keep every request in flight in one graph batch
                args = sglang_decode_batch_flags(args, concurrency=p.concurrency, admit=p.capture_lane or 0)
            args = place.flags(args)  # data parallel: its GPU, and its memory share when it shares that GPU
            cmd, env = sglang_launcher.build_command(
                model_dir=ext.model_dir, capture_dir=ext.capture_dir, host="127.0.0.1", port=port,
                aux_layer_ids=list(ext.aux_layer_ids), sglang_args=args)
            return local_server(cmd, port=port, log_path=ext.path(f"logs/server-{i}.log"), env=env)
        return LaunchSpec(f"sglang-{i}", make, launch_group=place.launch_group)

    make_spec = embedded if p.engine == "embedded" else sglang
    return [make_spec(i) for i in range(p.num_servers)]


def make_pool(ext: Extraction) -> ServerPool:
    """Given URLs, or the launched servers; several launched ones join as each is ready (work starts on the
    first: the next SGLang server of a GPU only starts once the previous is ready)."""
    p = ext.params
    if p.server_urls:
        return ServerPool(urls_given=p.server_urls, launch_timeout_s=p.launch_timeout_s)
    return ServerPool(specs=launch_specs(ext), launch_timeout_s=p.launch_timeout_s,
                      max_relaunches=max(1, p.max_relaunch_rounds) * 2, record_path=ext.path("servers.json"),
                      join_late=p.num_servers > 1)


def connect(ext: Extraction, pool: ServerPool, *, transport: httpx.AsyncBaseTransport | None = None) -> RunContext:
    """Preflight the servers against the run and the extraction's pinned provenance."""
    p = ext.params
    urls = pool.urls
    pf = _preflight(ext, urls)
    fp = ext.fingerprint
    expect = Expectation(aux_layer_ids=ext.aux_layer_ids, hidden_size=ext.hidden_size, num_layers=ext.num_layers,
                         model_hash=fp["model_hash"], tokenizer_hash=fp["tokenizer_hash"],
                         chat_template_hash=fp["chat_template_hash"])
    if pf.provenance is not None:
        diff = expect.mismatches(pf.provenance)
        if diff:
            raise PreflightError(f"the servers do not serve the run's model/tokenizer/template as tokenized here: "
                                 f"{'; '.join(diff)}")
    pinned_path = ext.path("provenance.json")
    pinned = contract.Provenance.from_json(pinned_path.read_text()) if pinned_path.is_file() else None
    if pinned is not None and pf.provenance is not None and pinned.mismatches(pf.provenance):
        raise ConfigChanged(f"extraction {ext.id} was captured with other numerics "
                            f"({', '.join(pinned.mismatches(pf.provenance))} differ from {pinned_path}); "
                            "use another extraction_id for this server setup")
    if pf.provenance is not None and pinned is None:
        atomic_write_bytes(pinned_path, pf.provenance.to_json().encode())
    expect = expect.pinned(pf.provenance or pinned) if (pf.provenance or pinned) else expect
    limit = ext.token_limit
    if pf.context_length:
        limit = min(limit, pf.context_length - max(1, p.context_headroom))
    dirs = [*pf.capture_dirs, *([p.server_capture_dir] if p.server_capture_dir else [])]
    client = ClientConfig(concurrency=p.concurrency, timeout_s=p.request_timeout_s, max_attempts=p.max_attempts,
                          backoff_s=p.backoff_s, backoff_max_s=max(p.backoff_s, 15.0),
                          lanes=((CAPTURE_LANE, p.capture_lane),) if p.capture_lane else ())
    ctx = RunContext(pool=pool, expect=expect, capture_dirs=tuple(dirs), max_prompt_tokens=limit, servers=list(urls),
                     client_config=client, validate_config=ValidateConfig(
                         shard_wait_s=p.shard_wait_s, min_argmax_agreement=p.min_argmax_agreement,
                         processes=default_check_processes(p.engine) if p.validate_processes is None
                         else p.validate_processes),
                     transport=transport)
    if p.regeneration.enabled:
        r = p.regeneration
        ctx.encoder = ChatEncoder(ext.model_dir)
        ctx.regen_config = RegenConfig(temperature=r.temperature, top_p=r.top_p, max_new_tokens=r.max_new_tokens,
                                       seed=r.seed, keep_cut=r.cut_answers == "keep")
        # the argmax check multiplies every answer token by the [V, H] LM head: on a GPU host this is the
        # validation's main cost on the CPU, so it runs on the GPU when there is one
        head = load_lm_head(ext.model_dir)
        ctx.lm_head = head.to("cuda") if torch.cuda.is_available() else head
    pool.on_join(lambda url: admit(ext, ctx, url))
    return ctx


def _preflight(ext: Extraction, urls: list[str]) -> Preflight:
    return preflight(urls, aux_layer_ids=ext.aux_layer_ids, require_capture_block=ext.params.engine == "embedded",
                     hidden_size=ext.hidden_size)


def admit(ext: Extraction, ctx: RunContext, url: str, *, attempts: int = 3, pause_s: float = 2.0) -> None:
    """A server that became ready after the run started: the same preflight as the first ones', held to the
    run's pinned provenance and prompt limit, then it takes work in the round in progress (or the next). Raises
    PreflightError for a server that must not (the pool retires it); a server that does not answer the
    preflight is asked ``attempts`` times first."""
    for attempt in range(attempts):
        try:
            pf = _preflight(ext, [url])
            break
        except (PreflightError, httpx.HTTPError):
            if attempt == attempts - 1:
                raise
            time.sleep(pause_s)
    if pf.provenance is not None and ctx.expect.provenance is not None:
        diff = ctx.expect.mismatches(pf.provenance)
        if diff:
            raise PreflightError(f"{url} serves other numerics than the run's servers: {'; '.join(diff)}")
    if pf.context_length and pf.context_length - max(1, ext.params.context_headroom) < ctx.max_prompt_tokens:
        raise PreflightError(f"{url} has a context of {pf.context_length} tokens, less than the run's prompts need")
    with ctx.lock:
        ctx.capture_dirs = (*ctx.capture_dirs, *(d for d in pf.capture_dirs if d not in ctx.capture_dirs))
        if url not in ctx.servers:
            ctx.servers.append(url)
        if ctx.client is not None:
            ctx.client.add_server(url)


def round_client(ctx: RunContext) -> EngineClient:
    """The client of a round: every admitted server; a server admitted while it runs joins it."""
    with ctx.lock:
        ctx.client = EngineClient(list(ctx.servers), config=ctx.client_config, transport=ctx.transport)
        return ctx.client


def end_round(ctx: RunContext) -> None:
    with ctx.lock:
        ctx.client = None


def after_revive(ctx: RunContext) -> None:
    """The servers of the next round after :meth:`ServerPool.revive`: the dead ones' URLs dropped, relaunched
    ones taken (with ``join_late`` they were admitted as they came up; otherwise, as before, without a preflight)."""
    live = ctx.pool.live_urls()
    with ctx.lock:
        ctx.servers = [u for u in ctx.servers if u in live] + [u for u in ctx.pool.urls if u not in ctx.servers]
