"""The embedded server captures exactly what a direct transformers forward computes."""

import concurrent.futures as cf

import httpx
import pytest
import torch

from eaglenest import contract


def reference(runner, ids):
    """Direct HF forward: aux = hidden_states[id + 1], final = hidden_states[-1] (post-norm)."""
    with torch.inference_mode():
        out = runner.model(input_ids=torch.tensor([ids]), output_hidden_states=True)
        hs = out.hidden_states
        assert len(hs) == runner.num_layers + 1
        aux = torch.cat([hs[i + 1][0] for i in runner.aux_layer_ids], dim=-1)
        # the final-norm output is what the LM head reads
        torch.testing.assert_close(runner.model.lm_head(hs[-1][0]), out.logits[0], rtol=0, atol=1e-5)
    return aux, hs[-1][0]


def prompts(n, seed=0, lo=3, hi=40):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(lo, hi, (n,), generator=g).tolist()
    return [torch.randint(3, 500, (t,), generator=g).tolist() for t in lengths]


def close_in_bf16(captured, ref):
    """Within one bf16 rounding step of the fp32 reference (the batch shape moves float rounding)."""
    assert (captured.float() - ref.to(torch.bfloat16).float()).abs().max() <= 2 ** -7 * ref.abs().max()


def assert_matches(captured_aux, captured_final, ref_aux, ref_final):
    # shards are bf16; the reference is fp32: equal after the same rounding
    torch.testing.assert_close(captured_aux, ref_aux.to(torch.bfloat16), rtol=0, atol=0)
    torch.testing.assert_close(captured_final, ref_final.to(torch.bfloat16), rtol=0, atol=0)


def test_capture_single_and_batched_equal_reference(tiny_runner):
    batch = prompts(6)
    together = tiny_runner.capture(batch)
    for ids, cap in zip(batch, together, strict=True):
        alone = tiny_runner.capture([ids])[0]
        ref_aux, ref_final = reference(tiny_runner, ids)
        assert cap.aux_hidden.shape == (len(ids), 3 * tiny_runner.hidden_size)
        # padding in a batch changes no captured value beyond fp32 rounding of the batch shape
        torch.testing.assert_close(cap.aux_hidden.float(), alone.aux_hidden.float(), rtol=0, atol=1e-2)
        d = (cap.final_hidden.float() - ref_final.to(torch.bfloat16).float()).abs().max()
        assert d <= 1e-2, d
        assert_matches(alone.aux_hidden, alone.final_hidden, ref_aux, ref_final)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_padding_and_neighbours_never_change_a_captured_value(tiny_model_dir, dtype):
    """Same batch shape, different pad ids and neighbour tokens: bit-identical captures (bf16 too)."""
    from eaglenest.engines.runtime import TargetRunner

    r = TargetRunner(tiny_model_dir, dtype=dtype)
    short, long_a, long_b = prompts(1, seed=3, lo=4, hi=9)[0], list(range(10, 50)), list(range(60, 100))
    first = r.capture([short, long_a], pad_token_id=0)[0]
    second = r.capture([short, long_b], pad_token_id=7)[0]
    assert torch.equal(first.aux_hidden.view(torch.int16), second.aux_hidden.view(torch.int16))
    assert torch.equal(first.final_hidden.view(torch.int16), second.final_hidden.view(torch.int16))


def test_server_writes_shard_before_answering(capture_server, tiny_runner):
    url, engine = capture_server
    ids = prompts(1, seed=5)[0]
    r = httpx.post(f"{url}/generate", json={"input_ids": ids, "rid": "sample-1",
                                            "sampling_params": {"max_new_tokens": 0}}, timeout=30)
    assert r.status_code == 200, r.text
    cap = r.json()["meta_info"]["capture"]
    path = engine.capture_dir / cap["shard"]
    assert path.is_file()  # durable when answered
    assert cap["aux_hidden"] == [len(ids), 3 * tiny_runner.hidden_size]
    shard = contract.read_shard(path)
    assert shard.input_ids.tolist() == ids
    assert shard.provenance == engine.provenance
    assert contract.sha256_bytes(path.read_bytes()) == cap["sha256"]
    ref_aux, ref_final = reference(tiny_runner, ids)
    close_in_bf16(shard.aux_hidden, ref_aux)
    close_in_bf16(shard.final_hidden, ref_final)


def test_concurrent_requests_are_batched_and_exact(capture_server, tiny_runner):
    url, engine = capture_server
    batch = prompts(16, seed=7)
    forwards0 = engine.stats["forwards"]

    def send(i):
        return httpx.post(f"{url}/generate", json={"input_ids": batch[i], "rid": f"c{i}",
                                                   "sampling_params": {"max_new_tokens": 0}}, timeout=60)

    with cf.ThreadPoolExecutor(16) as pool:
        responses = list(pool.map(send, range(16)))
    assert all(r.status_code == 200 for r in responses)
    assert engine.stats["forwards"] - forwards0 < 16  # some requests shared a forward
    for i, ids in enumerate(batch):
        shard = contract.read_shard(engine.capture_dir / f"c{i}.safetensors")
        ref_aux, ref_final = reference(tiny_runner, ids)
        assert shard.input_ids.tolist() == ids
        close_in_bf16(shard.aux_hidden, ref_aux)
        close_in_bf16(shard.final_hidden, ref_final)


def test_batched_body_and_generation(capture_server, tiny_runner):
    url, engine = capture_server
    batch = prompts(3, seed=9)
    r = httpx.post(f"{url}/generate", json={"input_ids": batch, "rid": ["b0", "b1", "b2"],
                                            "sampling_params": {"max_new_tokens": 6, "temperature": 0,
                                                                "ignore_eos": True}}, timeout=60)
    assert r.status_code == 200, r.text
    out = r.json()
    assert [o["meta_info"]["id"] for o in out] == ["b0", "b1", "b2"]
    for ids, o in zip(batch, out, strict=True):
        assert o["meta_info"]["completion_tokens"] == 6
        # greedy output equals transformers' own greedy decoding
        ref = tiny_runner.model.generate(torch.tensor([ids]), max_new_tokens=6, do_sample=False,
                                         min_new_tokens=6, attention_mask=torch.ones(1, len(ids), dtype=torch.long))
        assert o["output_ids"] == ref[0, len(ids):].tolist()
        # the prefill of a generating request is captured too, and only the prompt
        shard = contract.read_shard(engine.capture_dir / contract.shard_filename(o["meta_info"]["id"]))
        assert shard.input_ids.tolist() == ids


def test_text_input_and_no_capture_prefix(capture_server):
    url, engine = capture_server
    r = httpx.post(f"{url}/generate", json={"text": "def f(x): return x", "rid": "nocapture:bench-1",
                                            "sampling_params": {"max_new_tokens": 2, "temperature": 0}}, timeout=30)
    assert r.status_code == 200 and "capture" not in r.json()["meta_info"]
    assert list(contract.iter_shard_paths(engine.capture_dir)) == []


@pytest.mark.parametrize("rid", ["../x", "a/b", "/abs", "y" * 10_000])
def test_server_keeps_malicious_rids_inside_capture_dir(capture_server, rid):
    url, engine = capture_server
    r = httpx.post(f"{url}/generate", json={"input_ids": [5, 6, 7], "rid": rid,
                                            "sampling_params": {"max_new_tokens": 0}}, timeout=30)
    assert r.status_code == 200, r.text
    names = [p.name for p in engine.capture_dir.iterdir()]
    assert names == [r.json()["meta_info"]["capture"]["shard"]]
    assert contract.read_shard(engine.capture_dir / names[0]).sample_id == rid
    assert not (engine.capture_dir.parent / "x").exists()


@pytest.mark.parametrize(("body", "status", "needle"), [
    ({"input_ids": [1, 2], "rid": ""}, 400, "rid"),
    ({"input_ids": [], "rid": "e"}, 400, "input_ids"),
    ({"input_ids": ["a"], "rid": "e"}, 400, "input_ids"),
    ({"input_ids": [1, 10 ** 9], "rid": "e"}, 400, "vocabulary"),
    ({"input_ids": [1], "text": "x"}, 400, "exactly one"),
    ({"input_ids": [1] * 2049, "rid": "long", "sampling_params": {"max_new_tokens": 0}}, 413, "context"),
    ({"input_ids": [1, 2], "sampling_params": {"max_new_tokens": -1}}, 400, "max_new_tokens"),
    ([1, 2, 3], 400, "JSON object"),
])
def test_bad_requests_name_the_field(capture_server, body, status, needle):
    url, engine = capture_server
    r = httpx.post(f"{url}/generate", json=body, timeout=30)
    assert r.status_code == status
    assert needle in r.json()["error"]["message"]
    assert list(contract.iter_shard_paths(engine.capture_dir)) == []


def test_model_info_reports_capture_contract(capture_server, tiny_runner):
    url, engine = capture_server
    info = httpx.get(f"{url}/get_model_info").json()
    assert info["capture"]["aux_layer_ids"] == [1, 3, 4]
    assert contract.Provenance.from_json(info["capture"]["provenance"]) == engine.provenance
    assert httpx.get(f"{url}/health").status_code == 200


def test_a_reused_rid_answers_from_its_shard_or_409_and_the_client_stops(capture_server):
    url, engine = capture_server
    path = engine.capture_dir / "again.safetensors"

    def send(ids):
        return httpx.post(f"{url}/generate", json={"input_ids": ids, "rid": "again",
                                                   "sampling_params": {"max_new_tokens": 0}}, timeout=30)

    first = send([5, 6, 7])
    assert first.status_code == 200, first.text
    stored = path.read_bytes()
    same = send([5, 6, 7])  # a retry after a timeout: idempotent, the receipt is the stored file's
    assert same.status_code == 200, same.text
    cap = same.json()["meta_info"]["capture"]
    assert cap["existing"] and cap["num_tokens"] == 3 and cap["bytes"] == len(stored)
    assert cap["sha256"] == contract.sha256_bytes(stored) == first.json()["meta_info"]["capture"]["sha256"]
    other = send([5, 6, 7, 8])  # another request under a used rid: never a 200 for a capture not stored
    assert other.status_code == 409, other.text
    err = other.json()["error"]
    assert err["type"] == "rid_conflict" and "'again'" in err["message"] and "3 tokens stored, 4 sent" in err["message"]
    assert path.read_bytes() == stored and [p.name for p in engine.capture_dir.iterdir()] == [path.name]

    from eaglenest.data import Sample
    from eaglenest.extraction.client import ClientConfig
    from eaglenest.extraction.prefill import prefill

    res = prefill([Sample(sample_id="again", input_ids=[5, 6, 7, 8], loss_spans=()),
                   Sample(sample_id="fresh", input_ids=[9, 10], loss_spans=())], [url],
                  config=ClientConfig(max_attempts=3, backoff_s=0.0))
    f = res.failures["again"]  # terminal for that sample, named, sent once; the rest goes on
    assert (f.kind, f.reason, f.status, f.attempts) == ("terminal", "conflict", 409, 1) and "'again'" in f.message
    assert set(res.answers) == {"fresh"} and res.stats.requests == 2


def test_load_builds_on_the_scheduler_thread_and_serves_from_it(tiny_runner):
    """Every torch call of a loaded engine runs on its scheduler thread: the build too (a second OpenMP team,
    the loading thread's, slows small decode steps on a small CPU)."""
    import threading

    from eaglenest.engines.embedded import EmbeddedEngine, Work

    threads = []

    class Recording:
        def generate_greedy(self, input_ids, *, max_new_tokens, ignore_eos):
            threads.append(threading.current_thread())
            return tiny_runner.generate(input_ids, max_new_tokens=max_new_tokens, temperature=0.0,
                                        ignore_eos=ignore_eos)

    def build():
        threads.append(threading.current_thread())
        return tiny_runner, Recording()

    engine = EmbeddedEngine.load(build, capture_dir=None)
    try:
        result, shard = engine.submit(Work(rid="r", input_ids=[5, 6, 7], max_new_tokens=4, temperature=0.0,
                                           ignore_eos=True)).result(timeout=60)
    finally:
        engine.close()
    assert threads == [engine._thread, engine._thread] and engine._thread is not threading.current_thread()
    assert engine.runner is tiny_runner and shard is None
    assert result.output_ids == tiny_runner.generate([5, 6, 7], max_new_tokens=4, temperature=0.0,
                                                     ignore_eos=True).output_ids


def test_load_raises_what_the_build_raised():
    from eaglenest.engines.embedded import EmbeddedEngine

    def build():
        raise FileNotFoundError("no model at /nowhere")

    with pytest.raises(FileNotFoundError, match="/nowhere"):
        EmbeddedEngine.load(build, capture_dir=None)
