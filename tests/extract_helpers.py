"""Helpers shared by the extraction tests (not a test module)."""

import json
import time

from eaglenest import contract
from eaglenest.engines.pool import LaunchError
from eaglenest.extraction.config import ExtractParams


class Kill(BaseException):
    """The client dying mid-run (a BaseException, so no retry or handler in the run swallows it)."""


def kill_when(condition):
    """An ``on_progress`` callback that raises Kill once ``condition(progress)`` holds (SIGKILL-like: nothing after
    it runs)."""
    def on_progress(p):
        if condition(p):
            raise Kill
    return on_progress


def kill_after_tokens(n):
    """Kill once ``n`` tokens have been generated (mid-regeneration)."""
    return kill_when(lambda p: p.generated_tokens >= n)


def with_(params, **kw):
    return ExtractParams(**{**params.model_dump(), **kw})


def regen_source(tmp_path, n_prompts=2):
    """A JSONL source of ``n_prompts`` one-turn prompts (``p0`` ...) and a two-turn conversation ``c``."""
    rows = [{"id": f"p{i}", "prompt": f"Write a poem about the number {i}."} for i in range(n_prompts)]
    rows.append({"id": "c", "conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "old"},
                                              {"from": "human", "value": "more"}]})
    (tmp_path / "p.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    return str(tmp_path / "p.jsonl")


def ledger_lines(ext_dir):
    """Parseable ledger lines (a torn line left by a crash is not an entry)."""
    out = []
    for line in (ext_dir / "ledger.jsonl").read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out


def ledger_ids(ext_dir):
    return [e["sample_id"] for e in ledger_lines(ext_dir)]


def assert_complete_and_exact(report, ext_dir):
    """Every planned sample is in the ledger exactly once, with a valid shard of the same bytes."""
    ids = ledger_ids(ext_dir)
    assert report["complete"] and report["pending"] == 0
    assert len(ids) == len(set(ids)) == report["done"] == report["samples"]
    for e in ledger_lines(ext_dir):
        data = (ext_dir / "capture" / e["shard"]).read_bytes()
        assert contract.sha256_bytes(data) == e["sha256"]
        assert contract.decode_shard(data).num_tokens == e["num_tokens"]
    assert not list((ext_dir / "capture").glob("*.tmp"))


class StopAfter:
    """Test fake for the embedded engine's ``greedy_decoder``: the target's own greedy tokens, then its
    end-of-turn after ``k`` of them (a tiny random model never ends an answer by itself)."""

    def __init__(self, runner, k: int = 6, delay_s: float = 0.0) -> None:
        self.runner, self.k, self.delay_s = runner, k, delay_s

    def generate_greedy(self, input_ids, *, max_new_tokens, ignore_eos):
        from eaglenest.engines.runtime import Generation

        time.sleep(self.delay_s)
        g = self.runner.generate(input_ids, max_new_tokens=min(max_new_tokens, self.k), ignore_eos=True)
        if max_new_tokens <= self.k:
            return g
        return Generation([*g.output_ids, self.runner.tokenizer.eos_token_id], "stop", None, g.prefill_s, g.decode_s)


def record_rids(engine) -> list[str]:
    """Every rid the engine is asked for, in order (wraps its submit)."""
    rids: list[str] = []
    submit = engine.submit

    def recording(work):
        rids.append(work.rid)
        return submit(work)

    engine.submit = recording
    return rids


class ThreadServer:
    """An in-thread embedded server with ServerProcess's interface; ``stop_after`` requests it goes away."""

    def __init__(self, runner, capture_dir, port, stop_after=None):
        from eaglenest.engines.embedded import EmbeddedEngine
        from eaglenest.engines.serving import BackgroundServer

        self.engine = EmbeddedEngine(runner, capture_dir=capture_dir)
        self.bg = BackgroundServer(self.engine, port=port)
        self.url, self.pid = self.bg.url, None
        if stop_after is not None:
            submit, count = self.engine.submit, [0]

            def submit_then_die(work):
                count[0] += 1
                if count[0] > stop_after:
                    self.bg._server.should_exit = True  # the server goes away; in-flight work finishes
                return submit(work)

            self.engine.submit = submit_then_die

    def start(self):
        self.bg.start()
        return self

    def wait_ready(self, *, timeout_s, ready, poll_s=0.05):
        deadline = time.monotonic() + timeout_s
        while not ready(self.url):
            if time.monotonic() > deadline:
                raise LaunchError(f"in-thread server {self.url} not ready")
            time.sleep(poll_s)

    def alive(self):
        return self.bg._thread.is_alive()

    def stop(self):
        self.bg.stop()
        self.engine.close()


class WritesPrompts:
    """The tiny target's runner, except that a sampled generation (a self prompt: temperature > 0) is a request of
    its own, ``prompt <seed>`` words, that ends on its own; greedy answers and captures are the runner's."""

    def __init__(self, runner, tokenizer):
        self.runner, self.tok = runner, tokenizer

    def __getattr__(self, name):
        return getattr(self.runner, name)

    def generate(self, input_ids, *, temperature, seed=None, **kw):
        from eaglenest.engines.runtime import Generation

        if temperature <= 0:
            return self.runner.generate(input_ids, temperature=temperature, seed=seed, **kw)
        ids = self.tok.encode(f"Tell me about the number {seed % 5} in a long sentence", add_special_tokens=False)
        return Generation([*ids, self.tok.eos_token_id], "stop", None, 0.0, 0.0)
