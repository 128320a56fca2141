"""The prefill client against injected transports: what is retried, what is terminal, data parallelism."""

import asyncio
import json
from collections import Counter

import httpx
import pytest

from eaglenest import contract
from eaglenest.data import Sample
from eaglenest.extraction.client import Answer, ClientConfig, EngineClient, Job
from eaglenest.extraction.prefill import prefill, prefill_async

A, B = "http://a", "http://b"


def samples(n, t=5):
    return [Sample(sample_id=f"s{i}", input_ids=list(range(1, t + 1 + i % 3)), loss_spans=((1, 2),))
            for i in range(n)]


def ok(request, **meta):
    body = json.loads(request.content)
    t = len(body["input_ids"])
    info = {"id": body["rid"], "prompt_tokens": t, "cached_tokens": 0,
            "capture": {"shard": contract.shard_filename(body["rid"]), "num_tokens": t}}
    info.update(meta)
    return httpx.Response(200, json={"text": "", "output_ids": [], "meta_info": info})


def refuse(request):
    raise httpx.ConnectError("connection refused", request=request)


class Recorder:
    """A fake set of servers: ``rule(request, n, rid_count)`` answers; records every request. ``health``
    answers ``GET /health`` (default 200; ``refuse`` for a dead server)."""

    def __init__(self, rule, health=None):
        self.rule, self.calls, self.per_rid = rule, [], {}
        self.health, self.probes = health or (lambda req: httpx.Response(200)), []

    async def __call__(self, request):
        await asyncio.sleep(0)  # yield like a real connection, so every worker gets work
        if request.method == "GET" and request.url.path == "/health":
            self.probes.append(str(request.url.host))
            return self.health(request)
        rid = json.loads(request.content)["rid"]
        self.per_rid[rid] = self.per_rid.get(rid, 0) + 1
        self.calls.append((str(request.url.host), rid))
        return self.rule(request, len(self.calls), self.per_rid[rid])

    def transport(self):
        return httpx.MockTransport(self)


async def no_sleep(_s):
    return None


def run(rec, n=12, servers=(A,), **cfg):
    config = ClientConfig(**{"concurrency": 3, "max_attempts": 3, "backoff_s": 0.0, **cfg})
    return asyncio.run(prefill_async(samples(n), list(servers), config=config, transport=rec.transport(),
                                     sleep=no_sleep))


def test_transient_503_and_resets_are_retried_until_answered():
    def rule(req, n, tries):
        if tries == 1 and n % 3 == 0:
            return httpx.Response(503, json={"error": {"message": "busy"}})
        if tries == 1 and n % 4 == 0:
            raise httpx.RemoteProtocolError("peer closed connection", request=req)
        return ok(req)

    rec = Recorder(rule)
    res = run(rec)
    assert len(res.answers) == 12 and not res.failures  # nothing lost
    assert res.stats.retries == sum(v - 1 for v in rec.per_rid.values()) > 0
    assert max(rec.per_rid.values()) == 2  # each retried once, then answered
    # counted by what went wrong, for the report (on the GPU: which errors the bursts of retries were)
    assert set(res.stats.retry_errors) == {"server_error HTTP 503", "connection RemoteProtocolError"}
    assert sum(res.stats.retry_errors.values()) == res.stats.retries
    assert res.tokens == sum(s.num_tokens for s in samples(12))


@pytest.mark.parametrize(("status", "reason"), [(400, "client_error"), (413, "client_error"),
                                                (422, "client_error"), (507, "disk_full")])
def test_terminal_statuses_are_never_retried(status, reason):
    rec = Recorder(lambda req, n, tries: httpx.Response(status, json={"error": {"message": f"no ({status})"}}))
    res = run(rec, n=4)
    assert not res.answers and set(res.failures) == {f"s{i}" for i in range(4)}  # each reported, none lost
    failed = list(res.failures.values())
    assert all(f.kind == "terminal" for f in failed if f.reason == reason)
    if status == 507:  # disk full: the one server is taken out at once, no retry storm
        assert len(rec.calls) <= 3 and any(f.reason == "disk_full" for f in failed)
        assert all(f.reason in ("disk_full", "server_unavailable") for f in failed)
    else:
        assert len(rec.calls) == 4 and all(v == 1 for v in rec.per_rid.values())
        assert all(f"no ({status})" in f.message for f in failed)


def test_a_rid_conflict_is_a_terminal_failure_of_that_sample_only():
    def rule(req, n, tries):
        rid = json.loads(req.content)["rid"]
        if rid == "s1":
            return httpx.Response(409, json={"error": {"message": f"rid {rid!r} already has a shard with other "
                                                                  "input_ids", "type": "rid_conflict"}})
        return ok(req)

    rec = Recorder(rule)
    res = run(rec, n=4)
    f = res.failures["s1"]
    assert (f.kind, f.reason, f.status, f.attempts) == ("terminal", "conflict", 409, 1) and "'s1'" in f.message
    assert rec.per_rid["s1"] == 1 and set(res.answers) == {"s0", "s2", "s3"}


def test_retries_stop_at_max_attempts_with_the_reason():
    rec = Recorder(lambda req, n, tries: httpx.Response(500, json={"error": {"message": "boom"}}))
    res = run(rec, n=2, max_attempts=3, down_after=100)
    assert all(v == 3 for v in rec.per_rid.values())
    f = res.failures["s0"]
    assert f.kind == "retryable" and f.attempts == 3 and "gave up after 3 attempts" in f.message


def test_dead_server_is_taken_out_and_its_work_moves_to_the_live_one():
    def rule(req, n, tries):
        if req.url.host == "b":
            raise httpx.ConnectError("connection refused", request=req)
        return ok(req)

    rec = Recorder(rule, health=lambda req: refuse(req) if req.url.host == "b" else httpx.Response(200))
    res = run(rec, n=20, servers=(A, B), max_attempts=4, down_after=2)
    assert len(res.answers) == 20 and not res.failures
    assert res.stats.servers_down == [B] and "connection refused" in res.stats.down_reasons[0]
    assert set(rec.probes) == {"b"} and res.stats.streaks_survived == 0
    assert all(a.server == A for a in res.answers.values())
    assert sum(1 for host, _ in rec.calls if host == "b") <= 2 + 3  # down after 2 + in-flight ones


def test_a_live_server_that_resets_a_burst_of_connections_keeps_its_work():
    """Under load SGLang's HTTP server reset a burst of connections (on the H200 the client then took the only
    server out: 7,568 queued samples failed at once and the round restarted). /health still answers: it stays."""
    def rule(req, n, tries):
        if 5 <= n <= 14:  # ten resets in a row, far past down_after
            raise httpx.RemoteProtocolError("Server disconnected without sending a response.", request=req)
        return ok(req)

    rec = Recorder(rule)
    res = run(rec, n=30, max_attempts=4, down_after=2)
    assert len(res.answers) == 30 and not res.failures  # nothing failed, nothing left for another round
    assert res.stats.servers_down == [] and res.stats.streaks_survived >= 1 and rec.probes


@pytest.mark.parametrize(("probe_attempts", "stays"), [(3, True), (1, False)])
def test_a_server_whose_first_probes_fail_is_probed_again_before_it_goes(probe_attempts, stays):
    """On the H100 (2026-12-05) both live servers went out at once after a burst of resets: the round ended and
    ~1,000 requests in flight were aborted. A probe that fails (a reset connection) is tried again."""
    def rule(req, n, tries):
        if 5 <= n <= 14:
            raise httpx.ReadError("", request=req)
        return ok(req)

    def health(req):
        if len(rec.probes) <= 2:  # the first two probes meet the same resets
            raise httpx.ReadError("", request=req)
        return httpx.Response(200)

    rec = Recorder(rule, health=health)
    res = run(rec, n=30, servers=(A, B), max_attempts=4, down_after=2, probe_attempts=probe_attempts)
    if stays:  # nothing failed, nothing left for another round
        assert len(res.answers) == 30 and not res.failures
        assert res.stats.servers_down == [] and res.stats.streaks_survived >= 1 and len(rec.probes) >= 3
    else:  # one probe each: both servers out, the rest of the round fails (the H100's incident)
        assert sorted(res.stats.servers_down) == [A, B] and "ReadError" in res.stats.down_reasons[0]
        assert len(res.answers) < 30 and {f.kind for f in res.failures.values()} == {"retryable"}


def test_all_servers_dead_fails_fast_as_retryable():
    rec = Recorder(lambda req, n, tries: (_ for _ in ()).throw(httpx.ConnectError("refused", request=req)),
                   health=refuse)
    res = run(rec, n=30, servers=(A, B), max_attempts=10, down_after=2)
    assert not res.answers and len(res.failures) == 30
    assert {f.kind for f in res.failures.values()} == {"retryable"}
    assert any(f.reason == "server_unavailable" for f in res.failures.values())
    assert len(rec.calls) < 30  # most samples never hit a dead server


def test_timeouts_are_retryable():
    def rule(req, n, tries):
        if tries == 1 and n % 2 == 0:
            raise httpx.ReadTimeout("timed out", request=req)
        return ok(req)

    res = run(Recorder(rule), n=8, down_after=100)
    assert len(res.answers) == 8 and res.stats.retries == 4


@pytest.mark.parametrize(("meta", "match"), [
    ({"capture": {"shard": "other.safetensors", "num_tokens": 1}}, "wrote shard 'other.safetensors'"),
    ({"prompt_tokens": 1}, "computed 1 prompt tokens"),
    ({"cached_tokens": 3}, "reused 3 cached prompt tokens"),
])
def test_contract_violations_in_answers_are_terminal(meta, match):
    rec = Recorder(lambda req, n, tries: ok(req, **meta))
    res = run(rec, n=3)
    assert len(rec.calls) == 3 and not res.answers
    assert all(f.kind == "terminal" and f.reason == "contract" for f in res.failures.values())
    assert match in res.failures["s0"].message


def test_answer_without_capture_meta_is_accepted_like_sglang():
    def rule(req, n, tries):
        return httpx.Response(200, json={"text": "", "meta_info": {"id": "x", "prompt_tokens": len(
            json.loads(req.content)["input_ids"])}})

    assert len(run(Recorder(rule), n=5).answers) == 5


def test_two_servers_share_the_work_and_in_flight_is_bounded():
    in_flight, peak = {"a": 0, "b": 0}, {"a": 0, "b": 0}

    async def handler(req):
        host = req.url.host
        in_flight[host] += 1
        peak[host] = max(peak[host], in_flight[host])
        await asyncio.sleep(0.002)
        in_flight[host] -= 1
        return ok(req)

    res = asyncio.run(prefill_async(samples(40), [A, B], config=ClientConfig(concurrency=3),
                                    transport=httpx.MockTransport(handler)))
    per = res.stats.per_server
    assert len(res.answers) == 40 and per[A] + per[B] == 40 and per[A] > 5 and per[B] > 5
    assert max(peak.values()) <= 3


def test_workers_share_small_connection_pools(monkeypatch):
    """httpcore's pool scans all its connections on every request event (one pool of 1,280 kept the request
    loop 64% busy on the H200): workers are split into pools of at most ``pool_size`` (+1 spare), one
    TLS context for all, and every job still ends once."""
    import eaglenest.extraction.client as client_mod

    made = []

    class Recording(httpx.AsyncClient):
        def __init__(self, **kw):
            made.append(kw)
            super().__init__(**kw)

    monkeypatch.setattr(client_mod.httpx, "AsyncClient", Recording)
    rec = Recorder(lambda req, n, k: ok(req))
    cfg = ClientConfig(concurrency=5, pool_size=4, lanes=(("capture", 2),))
    client = EngineClient([A, B], config=cfg, transport=rec.transport())
    jobs = [Job(f"s{i}", {"rid": f"s{i}", "input_ids": [1, 2]}, lane="capture" if i % 3 == 0 else None)
            for i in range(60)]
    out = asyncio.run(client.run(jobs))
    assert sorted(o.key for o in out) == sorted(j.key for j in jobs) and len(rec.calls) == 60
    # (5 + 2) workers per server in pools of 4 and 3, each pool one server's (a late server gets its own)
    assert client.stats.pools == 4 and [kw["limits"].max_connections for kw in made] == [5, 4, 5, 4]
    assert len({id(kw["verify"]) for kw in made}) == 1


def test_progress_callback_and_sync_wrapper():
    seen = []
    rec = Recorder(lambda req, n, tries: ok(req))
    res = prefill(samples(6), [A], config=ClientConfig(concurrency=2), transport=rec.transport(),
                  on_progress=seen.append)
    assert len(res.answers) == 6
    assert [p.done for p in seen] == list(range(1, 7)) and seen[-1].total == 6 and seen[-1].requests == 6


def test_follow_up_jobs_go_ahead_of_queued_new_work():
    """A conversation's next turn (priority 0) is sent before conversations still waiting (priority 1), so
    finished samples flow on to capture while the queue of new ones keeps the engine busy."""
    from eaglenest.extraction.client import EngineClient, Job

    rec = Recorder(lambda req, n, tries: httpx.Response(200, json={"text": "x", "meta_info": {}}))
    client = EngineClient([A], config=ClientConfig(concurrency=1), transport=rec.transport())

    def follow(o):
        if "-" in o.key:
            return []
        return [Job(f"{o.key}-next", {"rid": f"{o.key}-next", "input_ids": [1]}, priority=0)]

    jobs = [Job(f"n{i}", {"rid": f"n{i}", "input_ids": [1]}) for i in range(3)]
    asyncio.run(client.run(jobs, on_outcome=follow))
    assert [rid for _, rid in rec.calls] == ["n0", "n0-next", "n1", "n1-next", "n2", "n2-next"]


def test_a_lane_keeps_its_slots_when_another_lanes_jobs_hang():
    """Captures waiting for their shards (here: until every generation is answered) must not take the slots of
    the generations. In one lane, captures sent first fill every slot and nothing moves; in their own lane the
    generations go on and the captures finish after them."""
    async def main(lanes):
        gens_done = asyncio.Event()
        answered = []

        async def handler(request):
            rid = json.loads(request.content)["rid"]
            if rid.startswith("cap"):
                await gens_done.wait()
            answered.append(rid)
            if sum(r.startswith("gen") for r in answered) == 6:
                gens_done.set()
            return httpx.Response(200, json={"text": "", "meta_info": {"id": rid}})

        lane = "capture" if lanes else None
        jobs = [Job(f"cap{i}", {"rid": f"cap{i}"}, priority=0, lane=lane) for i in range(4)]
        jobs += [Job(f"gen{i}", {"rid": f"gen{i}"}, priority=1) for i in range(6)]
        client = EngineClient([A], config=ClientConfig(concurrency=2, lanes=(("capture", 2),) if lanes else ()),
                              transport=httpx.MockTransport(handler), sleep=no_sleep)
        await asyncio.wait_for(client.run(jobs), timeout=2)
        return answered

    answered = asyncio.run(main(lanes=True))
    assert [r[:3] for r in answered] == ["gen"] * 6 + ["cap"] * 4
    with pytest.raises(TimeoutError):  # one lane: the hanging captures hold both slots
        asyncio.run(main(lanes=False))
    with pytest.raises(ValueError, match="asks for lane 'other'"):
        asyncio.run(EngineClient([A], transport=httpx.MockTransport(lambda r: httpx.Response(200))).run(
            [Job("x", {"rid": "x"}, lane="other")]))


def test_a_server_added_during_the_call_takes_work_at_once():
    """A server that becomes ready after the call started (the next SGLang server of a GPU) gets its workers at
    once: here A holds its two requests until B has answered, so without the join nothing would finish."""
    async def main():
        b_answered = asyncio.Event()
        per_server = Counter()

        async def handler(request):
            rid = json.loads(request.content)["rid"]
            per_server[request.url.host] += 1
            if request.url.host == "a":
                await b_answered.wait()
            else:
                b_answered.set()
            return httpx.Response(200, json={"text": "", "meta_info": {"id": rid}})

        client = EngineClient([A], config=ClientConfig(concurrency=2), transport=httpx.MockTransport(handler),
                              sleep=no_sleep)
        run = asyncio.create_task(client.run([Job(f"s{i}", {"rid": f"s{i}"}) for i in range(10)]))
        await asyncio.sleep(0.05)
        assert not run.done() and per_server == {"a": 2}
        joined = await asyncio.to_thread(client.add_server, B)  # from another thread, as the pool's launcher does
        out = await asyncio.wait_for(run, timeout=5)
        return client, joined, out, per_server

    client, joined, out, per_server = asyncio.run(main())
    assert joined and sorted(o.key for o in out) == [f"s{i}" for i in range(10)]
    assert all(isinstance(o, Answer) for o in out) and per_server["b"] >= 8
    assert client.stats.per_server == {A: 2, B: 8} and client.stats.pools == 2
    assert client.add_server("http://c") is False  # the call has ended
