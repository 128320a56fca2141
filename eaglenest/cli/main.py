"""Command line: ``eaglenest serve | model | demo`` and the sub-apps. Thin: parses arguments, calls the library.

:func:`main` is the entry point: expected user mistakes end in one line and exit code 2
(:mod:`eaglenest.cli.errors`); ``--debug`` anywhere on the command line keeps the traceback.
"""

from __future__ import annotations

import logging
import sys
from enum import StrEnum
from pathlib import Path
from typing import Annotated

import typer

from eaglenest.cli import errors
from eaglenest.cli.bench import app as bench_app
from eaglenest.cli.extract import app as extract_app
from eaglenest.cli.options import parse_ids
from eaglenest.cli.store import app as store_app
from eaglenest.cli.train import app as train_app
from eaglenest.extraction.starters import STARTER_SETS_HELP

app = typer.Typer(add_completion=False, no_args_is_help=True, help="EAGLE-3 drafters from engine-native hidden states.")
model_app = typer.Typer(no_args_is_help=True, help="Target models.")
app.add_typer(model_app, name="model")
app.add_typer(extract_app, name="extract")
app.add_typer(store_app, name="store")
app.add_typer(train_app)  # eaglenest train | export
app.add_typer(bench_app, name="bench")  # eaglenest bench live | cpu | offline | prompts | plot | serve
prompts_app = typer.Typer(no_args_is_help=True, help="Prompt sources for training data.")
app.add_typer(prompts_app, name="prompts")


@app.callback()
def root(
    debug: Annotated[bool, typer.Option("--debug", help="print the traceback of any error (also after a command)")]
    = False,
) -> None:
    """EAGLE-3 drafters from engine-native hidden states."""


class Engine(StrEnum):
    embedded = "embedded"
    sglang = "sglang"


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def serve(
    ctx: typer.Context,
    engine: Annotated[Engine, typer.Option(help="embedded (CPU) or sglang (GPU)")] = Engine.embedded,
    model: Annotated[str, typer.Option(help="'default' (SmolLM2-135M-Instruct) or a local HF folder")] = "default",
    capture_dir: Annotated[Path | None, typer.Option(
        help="write one shard per request id here, write-once: a rid sent again with other input_ids gets 409 "
             "(off if unset)")] = None,
    host: Annotated[str, typer.Option(help="bind address")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="port")] = 30000,
    aux_layers: Annotated[
        str | None, typer.Option(help="aux decoder layer ids, e.g. 1,14,26 (default [1, L//2-1, L-4])")
    ] = None,
    dtype: Annotated[str, typer.Option(help="auto | bfloat16 | float32")] = "auto",
    max_batch_size: Annotated[int, typer.Option(help="embedded: most prefill requests per forward")] = 8,
    max_batch_tokens: Annotated[int, typer.Option(help="embedded: most padded tokens per forward")] = 8192,
) -> None:
    """Serve a target model with hidden-state capture (SGLang's native HTTP API subset).

    For --engine sglang, arguments after `--` go to sglang.launch_server unchanged.
    """
    from eaglenest.models import resolve_model

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    model_dir = resolve_model(model)
    ids = parse_ids(aux_layers)
    if engine is Engine.embedded:
        if ctx.args:
            raise typer.BadParameter(f"unexpected arguments for the embedded engine: {ctx.args}")
        from eaglenest.engines.embedded import ServerSettings
        from eaglenest.engines.serving import build_engine
        from eaglenest.engines.serving import serve as run

        eng = build_engine(model_dir, capture_dir=capture_dir, aux_layer_ids=ids, dtype=dtype,
                           settings=ServerSettings(max_batch_size=max_batch_size, max_batch_tokens=max_batch_tokens))
        typer.echo(f"embedded server: {model_dir} ({eng.runner.dtype_name}) aux {list(eng.runner.aux_layer_ids)} "
                   f"capture {'-> ' + str(capture_dir) if capture_dir else 'off'} on http://{host}:{port}", err=True)
        run(eng, host=host, port=port)
        return
    from eaglenest.engines import sglang_launcher

    sglang_launcher.serve_foreground(model_dir=model_dir, capture_dir=capture_dir, host=host, port=port,
                                     aux_layer_ids=ids, sglang_args=list(ctx.args))


@app.command()
def demo(
    out: Annotated[Path, typer.Option(help="working folder (make demo's pipeline uses runs/demo)")] = Path(
        "runs/demo-capture"),
    port: Annotated[int, typer.Option(help="port for the embedded server")] = 0,
) -> None:
    """Serve the real SmolLM2 on the embedded engine and capture one chat prompt."""
    import httpx

    from eaglenest.contract import read_shard
    from eaglenest.engines.pool import embedded_command, free_port, launched, local_server
    from eaglenest.models import ensure_default_model

    model_dir = ensure_default_model()
    port = port or free_port()
    capture = out / "capture"
    cmd = embedded_command(model=str(model_dir), port=port, capture_dir=str(capture))
    server = local_server(cmd, port=port, log_path=out / "server.log")
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    messages = [{"role": "user", "content": "Explain speculative decoding in one sentence."}]
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
    with launched(server, timeout_s=180):
        r = httpx.post(f"{server.url}/generate", json={"input_ids": ids, "rid": "demo-0",
                       "sampling_params": {"max_new_tokens": 48, "temperature": 0}}, timeout=120)
        r.raise_for_status()
    body = r.json()
    shard = read_shard(capture / body["meta_info"]["capture"]["shard"])
    typer.echo(f"answer: {body['text']!r}")
    typer.echo(f"shard: {capture / body['meta_info']['capture']['shard']}  tokens {shard.num_tokens}  "
               f"aux_hidden {list(shard.aux_hidden.shape)}  final_hidden {list(shard.final_hidden.shape)}  "
               f"aux layers {list(shard.provenance.aux_layer_ids)}")


@model_app.command("fetch")
def model_fetch() -> None:
    """Fetch and convert the default model (SmolLM2-135M-Instruct) once; print its folder."""
    from eaglenest.models import ensure_default_model

    typer.echo(str(ensure_default_model()))


@model_app.command("tiny")
def model_tiny(out: Path, layers: int = 8, hidden: int = 64, vocab: int = 512, seed: int = 0) -> None:
    """Build a tiny random Llama (with a BPE tokenizer and ChatML template) into OUT."""
    from eaglenest.testing.tiny_model import build_tiny_llama

    typer.echo(str(build_tiny_llama(out, layers=layers, hidden=hidden, vocab=vocab, seed=seed)))


def main(argv: list[str] | None = None) -> int:
    """``eaglenest ...``: run the app; a user error is one line and exit code 2 (a traceback with --debug)."""
    args = list(sys.argv[1:] if argv is None else argv)
    debug = errors.debug_requested(args)
    args = [a for a in args if a != "--debug"]
    try:
        app(args=args, prog_name="eaglenest")  # usage errors: click prints them and exits 2 itself
    except SystemExit as e:  # click ends every command with one (0 on success)
        return e.code if isinstance(e.code, int) else int(e.code is not None)
    except Exception as e:
        code = errors.report(e, debug=debug, prog="eaglenest")
        if code is None:
            raise
        return code
    finally:
        errors.debug_requested([])  # --debug holds for this command line only
    return 0


@prompts_app.command("self")
@errors.one_line
def prompts_self(
    out: Annotated[Path, typer.Option(help="JSONL file to write (.xz: compressed), a source for `eaglenest extract`")],
    count: Annotated[int, typer.Option(help="user prompts to ask the target for")] = 1000,
    model: Annotated[str, typer.Option(help="'default' (SmolLM2-135M-Instruct) or a local HF folder")] = "default",
    server_url: Annotated[list[str] | None, typer.Option(
        help="running server(s) of the target (repeatable); none: one server of --engine is launched")] = None,
    engine: Annotated[Engine, typer.Option(help="the server launched when no --server-url is given")] = Engine.embedded,
    sglang_arg: Annotated[list[str] | None, typer.Option(help="extra argument of a launched SGLang server")] = None,
    seed: Annotated[int, typer.Option(help="base seed (prompt i has its own)")] = 0,
    temperature: Annotated[float, typer.Option(help="sampling temperature (> 0)")] = 1.0,
    top_p: Annotated[float, typer.Option(help="nucleus sampling")] = 0.95,
    max_new_tokens: Annotated[int, typer.Option(help="a longer prompt is cut and left out")] = 256,
    concurrency: Annotated[int, typer.Option(help="requests in flight per server")] = 64,
    exclude_prompt_set: Annotated[list[str] | None, typer.Option(
        help="leave out prompts equal to a user turn of this evaluation set (repeatable)")] = None,
    exclude_file: Annotated[Path | None, typer.Option(
        help="the same from a JSON list of user texts (machines without the evaluation sets' packages)")] = None,
    starter: Annotated[list[str] | None, typer.Option(
        help="an opening of the user's text that the target continues (repeatable; prompts take them in turn)")] = None,
    starter_set: Annotated[list[str] | None, typer.Option(
        help=f"a built-in set of openings, added to --starter (repeatable): {STARTER_SETS_HELP}")] = None,
) -> None:
    """Let the target write user prompts itself (its template up to a user turn, sampled): training data that
    needs no dataset. The regeneration recipe then lets it answer them. Given --server-url, those servers must
    serve --model (--engine and --sglang-arg apply only to a launched server)."""
    import contextlib
    import json
    import tempfile

    from eaglenest.engines.pool import embedded_command, free_port, launched, local_server
    from eaglenest.extraction.client import ClientConfig
    from eaglenest.extraction.self_prompts import SelfPromptConfig, exclusions, self_prompts, starters_of
    from eaglenest.models import resolve_model

    model_dir = resolve_model(model)
    try:
        starters = starters_of(starter_set or (), starter or (), name="--starter-set")
        cfg = SelfPromptConfig(count=count, seed=seed, temperature=temperature, top_p=top_p,
                               max_new_tokens=max_new_tokens, starters=starters)
        exclude = exclusions(exclude_prompt_set or (), exclude_file, name="--exclude-file")
    except ValueError as e:
        raise errors.UsageError(str(e)) from None
    with contextlib.ExitStack() as stack:
        urls = list(server_url or [])
        if not urls:
            logs = Path(stack.enter_context(tempfile.TemporaryDirectory()))
            port, env = free_port(), {}
            if engine == Engine.sglang:  # no capture: these requests only generate
                from eaglenest.engines import sglang_launcher
                from eaglenest.engines.sglang_flags import sglang_decode_batch_flags

                args = sglang_decode_batch_flags(list(sglang_arg or []), concurrency=concurrency, admit=0)
                cmd, env = sglang_launcher.build_command(model_dir=model_dir, capture_dir=None, port=port,
                                                         sglang_args=args)
            else:
                cmd = embedded_command(model=str(model_dir), port=port, capture_dir=None)
            server = local_server(cmd, port=port, log_path=logs / "server.log", env=env)
            urls = [stack.enter_context(launched(server, timeout_s=900.0)).url]
        report = self_prompts(urls, model_dir, cfg, out, exclude=exclude,
                              client=ClientConfig(concurrency=concurrency))
        # before the launched server is stopped (SGLang's shutdown can take a while; a call killed meanwhile by
        # its time limit lost the report of prompts already written, H200 2026-12-03)
        typer.echo(json.dumps(report, indent=1))
