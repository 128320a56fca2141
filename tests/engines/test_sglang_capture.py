"""The SGLang capture plugin's GPU-free logic, driven with fake SGLang batch metadata on the CPU.

Rows carry their identity (request index, prompt position, layer) so every split, chunk join and
shard row can be checked exactly; the plugin glue (batch views, wrapped logits processor, copier,
writer, receipts, HTTP hold) runs as in a scheduler, minus the GPU.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from types import SimpleNamespace

import pytest
import torch

from eaglenest import contract, engines
from eaglenest.engines import sglang_plugin as plugin
from eaglenest.engines.sglang_capture import (
    CaptureConfig,
    CaptureError,
    CaptureWriter,
    Coalescer,
    Complete,
    Failed,
    HostBatch,
    ReqView,
    plan_segments,
)
from eaglenest.engines.sglang_receipts import receipt_path, wait_for_receipt, write_receipt
from eaglenest.engines.sglang_staging import ProcessWriter

H, IDS = 8, (0, 1, 2)
EXTEND = "EXTEND"


def provenance() -> contract.Provenance:
    return contract.Provenance(engine="sglang", engine_version="0.5.17", model_path="/m", model_hash="h",
                               tokenizer_hash="t", chat_template_hash="c", dtype="bfloat16", tp_size=1,
                               attention_backend="triton", aux_layer_ids=IDS, hidden_size=H, num_layers=4)


def rows_for(req: int, positions: range) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Per-layer aux rows [n, H] and final rows [n, H] tagged (req, position, layer)."""
    pos = torch.tensor(list(positions), dtype=torch.float32)
    n = len(pos)

    def tagged(layer: int) -> torch.Tensor:
        t = torch.zeros(n, H)
        t[:, 0], t[:, 1], t[:, 2] = req, pos, layer
        return t

    return [tagged(i) for i in IDS], tagged(9)


def flatten(parts: list[tuple[int, range]]) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The flattened prefill batch as SGLang hands it to the logits processor."""
    auxs, finals = zip(*(rows_for(r, p) for r, p in parts), strict=True)
    aux = [torch.cat([a[i] for a in auxs]) for i in range(len(IDS))]
    return torch.cat(finals), aux


def view(rid, prefix, extend, prompt, capture=True):
    return ReqView(rid, prefix, extend, prompt, capture, list(range(100, 100 + prompt)) if capture else None)


def check_shard(path, req: int, prompt: int) -> contract.Shard:
    shard = contract.read_shard(path)
    assert shard.num_tokens == prompt
    assert shard.input_ids.tolist() == list(range(100, 100 + prompt))
    assert shard.final_hidden[:, 0].eq(req).all() and shard.final_hidden[:, 2].eq(9).all()
    assert shard.final_hidden[:, 1].tolist() == list(range(prompt))
    for k in range(len(IDS)):  # aux = [layer 0 | layer 1 | layer 2], every row in prompt order
        block = shard.aux_hidden[:, k * H:(k + 1) * H]
        assert block[:, 0].eq(req).all() and block[:, 2].eq(IDS[k]).all()
        assert block[:, 1].tolist() == list(range(prompt))
    return shard


def test_plan_segments_maps_rows_and_skips_uncaptured():
    views = [view("a", 0, 3, 3), view("nocapture:b", 0, 2, 2, capture=False), view("c", 0, 4, 4), view("d", 0, 1, 1)]
    segments, ranges = plan_segments(views, 10)
    assert [(s.view.rid, s.row_start, s.host_start) for s in segments] == [("a", 0, 0), ("c", 5, 3), ("d", 9, 7)]
    assert ranges == [(0, 3), (5, 10)]
    with pytest.raises(CaptureError, match="11 hidden-state rows"):
        plan_segments(views, 11)


def test_coalescer_joins_chunks_and_fails_what_was_not_computed():
    c = Coalescer()
    aux, fin = rows_for(0, range(0, 4))
    assert c.add(view("x", 0, 4, 10), torch.cat(aux, -1), fin) is None
    aux2, fin2 = rows_for(0, range(4, 10))
    done = c.add(view("x", 4, 6, 10), torch.cat(aux2, -1), fin2)
    assert isinstance(done, Complete) and done.final_hidden[:, 1].tolist() == list(range(10)) and len(c) == 0
    reused = c.add(view("y", 6, 4, 10), fin2[:4], fin2[:4])
    assert isinstance(reused, Failed) and "[0, 6)" in reused.message and "--disable-radix-cache" in reused.message
    over = c.add(view("z", 0, 12, 10), fin2, fin2)
    assert isinstance(over, Failed) and "beyond its prompt" in over.message
    c.add(view("w", 0, 4, 10), fin2[:4], fin2[:4])  # restarted prefill replaces a stale partial
    assert c.add(view("w", 0, 4, 10), fin2[:4], fin2[:4]) is None and len(c) == 1
    gap = c.add(view("w", 5, 5, 10), fin2[:5], fin2[:5])
    assert isinstance(gap, Failed) and "[4, 5)" in gap.message and len(c) == 0
    small = Coalescer(max_pending=2)
    for rid in "abc":
        small.add(view(rid, 0, 1, 5), fin2[:1], fin2[:1])
    assert len(small) == 2


def test_partial_chunks_are_copied_out_of_the_reused_buffer():
    c = Coalescer()
    buf = torch.ones(4, H)
    c.add(view("x", 0, 4, 8), buf, buf)
    buf.fill_(7)  # the host slot is reused for the next batch
    done = c.add(view("x", 4, 4, 8), torch.zeros(4, H), torch.zeros(4, H))
    assert done.final_hidden[:4].eq(1).all()


@pytest.fixture
def writer(tmp_path):
    w = CaptureWriter(capture_dir=tmp_path / "capture", receipt_dir=tmp_path / "receipts", provenance=provenance())
    yield w
    w.close()


def host_batch(views, parts, calls):
    final, aux = flatten(parts)
    segments, ranges = plan_segments(views, final.shape[0])
    pick = torch.cat([torch.arange(a, b) for a, b in ranges])
    return HostBatch(segments, torch.cat(aux, -1)[pick].bfloat16(), final[pick].bfloat16(),
                     ready=lambda: calls.append("ready"), release=lambda: calls.append("release"))


def read_receipt(tmp_path, rid):
    return json.loads(receipt_path(tmp_path / "receipts", rid).read_text())


def test_writer_splits_two_forwards_into_shards_with_receipts(writer, tmp_path):
    calls: list[str] = []
    # forward 1: a whole, b first chunk, a no-capture request between; forward 2: b's last chunk, then c
    views1 = [view("a", 0, 3, 3), view("nocapture:n", 0, 2, 2, capture=False), view("b", 0, 4, 7)]
    writer.submit(host_batch(views1, [(0, range(3)), (5, range(2)), (1, range(4))], calls))
    views2 = [view("b", 4, 3, 7), view("c", 0, 5, 5)]
    writer.submit(host_batch(views2, [(1, range(4, 7)), (2, range(5))], calls))
    writer.close()
    cap = tmp_path / "capture"
    assert sorted(p.name for p in contract.iter_shard_paths(cap)) == ["a.safetensors", "b.safetensors",
                                                                      "c.safetensors"]
    for rid, req, prompt in (("a", 0, 3), ("b", 1, 7), ("c", 2, 5)):
        check_shard(cap / contract.shard_filename(rid), req, prompt)
        receipt = read_receipt(tmp_path, rid)
        data = (cap / receipt["shard"]).read_bytes()
        assert receipt["ok"] and receipt["num_tokens"] == prompt and receipt["bytes"] == len(data)
        assert receipt["sha256"] == contract.sha256_bytes(data) and receipt["aux_hidden"] == [prompt, 3 * H]
    assert calls == ["ready", "release", "ready", "release"]
    assert writer.stats["shards"] == 3 and writer.stats["failures"] == 0


def test_writer_never_persists_non_finite_states_and_says_why(writer, tmp_path):
    calls: list[str] = []
    batch = host_batch([view("bad", 0, 2, 2)], [(0, range(2))], calls)
    batch.final_hidden[1, 3] = float("nan")
    writer.submit(batch)
    writer.close()
    assert not list(contract.iter_shard_paths(tmp_path / "capture"))
    receipt = read_receipt(tmp_path, "bad")
    assert not receipt["ok"] and receipt["status"] == 422 and "non-finite" in receipt["message"]
    assert calls == ["ready", "release"]


def test_writer_reports_disk_full_as_507(writer, tmp_path, monkeypatch):
    import errno

    def full(path, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(contract, "publish_once", full)
    writer.submit(host_batch([view("d", 0, 2, 2)], [(0, range(2))], []))
    writer.close()
    receipt = read_receipt(tmp_path, "d")
    assert receipt["status"] == 507 and receipt["kind"] == "disk_full"


def test_wait_for_receipt_consumes_it_or_times_out(tmp_path):
    now = [0.0]

    async def fake_sleep(s):
        now[0] += s
        if now[0] > 0.05:
            write_receipt(tmp_path, "r", {"ok": True, "shard": "r.safetensors"})

    got = asyncio.run(wait_for_receipt(tmp_path, "r", timeout_s=5, sleep=fake_sleep, clock=lambda: now[0]))
    assert got["ok"] and got["rid"] == "r" and not receipt_path(tmp_path, "r").exists()

    async def idle(s):
        now[0] += s

    late = asyncio.run(wait_for_receipt(tmp_path, "q", timeout_s=1, sleep=idle, clock=lambda: now[0]))
    assert late["status"] == 504 and not late["ok"]


def test_config_round_trips_through_the_environment(tmp_path):
    cfg = CaptureConfig(capture_dir=tmp_path / "c", receipt_dir=tmp_path / "r", aux_layer_ids=(1, 3, 4))
    assert CaptureConfig.from_env(cfg.to_env()) == cfg
    assert CaptureConfig.from_env({}) is None
    with pytest.raises(CaptureError, match="bad eaglenest capture setting"):
        CaptureConfig.from_env({"EAGLENEST_CAPTURE_DIR": str(tmp_path), "EAGLENEST_AUX_LAYERS": "1,x"})
    with pytest.raises(CaptureError, match="EAGLENEST_CAPTURE_WRITER='fork'"):
        CaptureConfig.from_env({"EAGLENEST_CAPTURE_DIR": str(tmp_path), "EAGLENEST_CAPTURE_WRITER": "fork"})
    assert CaptureConfig.from_env(dataclasses.replace(cfg, writer="thread").to_env()).writer == "thread"


# ---------------------------------------------------------------- plugin glue, fake sglang objects
def fake_req(rid, prompt, **kw):
    return SimpleNamespace(rid=rid, origin_input_ids=list(range(100, 100 + prompt)), output_ids=kw.get("out", []),
                           to_finish=kw.get("to_finish"), input_embeds=None, multimodal_inputs=None)


@dataclasses.dataclass
class FakeForwardBatch:
    forward_mode: str
    extend_prefix_lens_cpu: list
    extend_seq_lens_cpu: list
    rids: list


def forward(runtime, lp, runner, reqs, prefix, extend, parts, mode=EXTEND):
    """One scheduler step: ForwardBatch.init_new (hooked) then the model's logits processor call, which
    gets a dataclasses.replace copy of the ForwardBatch, as sglang's eager runner hands it over."""
    batch = SimpleNamespace(reqs=reqs, prefix_lens=prefix, extend_lens=extend)
    fb = FakeForwardBatch(mode, prefix, extend, [r.rid for r in reqs])
    plugin._after_init_new(fb, "cls", batch, runner)
    final, aux = flatten(parts)
    return lp(torch.zeros(final.shape[0]), final, "lm_head", dataclasses.replace(fb), aux)


def logits_processor(runtime):
    """A stand-in for sglang's LogitsProcessor, wrapped by the plugin like the target's."""

    class LogitsProcessor(torch.nn.Module):
        def forward(self, input_ids, hidden_states, lm_head, logits_metadata, aux_hidden_states=None):
            return hidden_states.shape[0]

    lp = LogitsProcessor()
    plugin.wrap_logits_processor(lp, runtime)
    return lp


@pytest.fixture(params=["thread", "process"])
def glue(request, tmp_path, monkeypatch):
    # "process": the production path, shards written by a child process from /dev/shm slots
    shared = request.param == "process"
    writer_cls = ProcessWriter if shared else CaptureWriter
    writer = writer_cls(capture_dir=tmp_path / "capture", receipt_dir=tmp_path / "receipts", provenance=provenance())
    runner = object()
    runtime = plugin.CaptureRuntime(writer=writer, copier=plugin.DeviceCopier(2, shared=shared), num_aux=3,
                                    extend_mode=EXTEND, runner=runner)

    lp = logits_processor(runtime)
    monkeypatch.setattr(plugin, "_runtime", runtime)
    yield runtime, lp, runner, writer
    writer.close()


def test_plugin_glue_captures_prefill_chunks_and_skips_the_rest(glue, tmp_path):
    runtime, lp, runner, writer = glue
    # step 1: "a" whole, "nocapture:x", "b" chunk 1/2, an aborting request and a re-prefill after retraction
    reqs = [fake_req("a", 3), fake_req("nocapture:x", 2), fake_req("b", 6), fake_req("gone", 1, to_finish="abort"),
            fake_req("again", 2, out=[5])]
    assert forward(runtime, lp, runner, reqs, [0, 0, 0, 0, 0], [3, 2, 4, 1, 2],
                   [(0, range(3)), (7, range(2)), (1, range(4)), (8, range(1)), (9, range(2))]) == 12
    forward(runtime, lp, runner, [fake_req("b", 6)], [0], [1], [(1, range(1))], mode="DECODE")  # not prefill
    forward(runtime, lp, object(), [fake_req("draft", 2)], [0], [2], [(6, range(2))])  # another runner
    forward(runtime, lp, runner, [fake_req("b", 6), fake_req("c", 2)], [4, 0], [2, 2], [(1, range(4, 6)),
                                                                                      (2, range(2))])
    writer.close()
    cap = tmp_path / "capture"
    assert sorted(p.name for p in contract.iter_shard_paths(cap)) == ["a.safetensors", "b.safetensors",
                                                                      "c.safetensors"]
    check_shard(cap / "a.safetensors", 0, 3)
    check_shard(cap / "b.safetensors", 1, 6)
    check_shard(cap / "c.safetensors", 2, 2)


def test_plugin_glue_answers_a_reused_rid_from_its_shard_or_409(glue, tmp_path):
    runtime, lp, runner, _writer = glue
    receipts, path = tmp_path / "receipts", tmp_path / "capture" / "r.safetensors"

    def receipt_of(req, parts):
        forward(runtime, lp, runner, [req], [0], [len(req.origin_input_ids)], parts)
        return asyncio.run(wait_for_receipt(receipts, "r", timeout_s=30))  # consumed, as the HTTP side does

    first = receipt_of(fake_req("r", 3), [(0, range(3))])
    stored = path.read_bytes()
    assert first["ok"] and not first["existing"] and first["sha256"] == contract.sha256_bytes(stored)
    same = receipt_of(fake_req("r", 3), [(5, range(3))])  # same tokens, other numerics: the stored file stands
    assert same["ok"] and same["existing"] and {**same, "existing": False} == first
    check_shard(path, 0, 3)
    other = receipt_of(fake_req("r", 4), [(6, range(4))])  # other tokens under a used rid
    assert not other["ok"] and other["status"] == 409 and other["kind"] == "rid_conflict"
    assert "'r'" in other["message"] and "3 tokens stored, 4 sent" in other["message"]
    assert path.read_bytes() == stored and sorted(p.name for p in path.parent.iterdir()) == [path.name]
    with pytest.raises(plugin.CaptureFailed) as e:  # sglang answers the HTTP request with the receipt's status
        run_hold([{"meta_info": {"finish_reason": {"type": "length"}}}], tmp_path / "http", rid="r", receipt=other)
    assert e.value.status_code == 409 and "'r'" in str(e.value)


def test_plugin_glue_accepts_packed_aux_states(glue, tmp_path):
    _runtime, lp, runner, writer = glue
    batch = SimpleNamespace(reqs=[fake_req("packed", 4)], prefix_lens=[0], extend_lens=[4])
    fb = FakeForwardBatch(EXTEND, [0], [4], ["packed"])
    plugin._after_init_new(fb, "cls", batch, runner)
    final, aux = flatten([(3, range(4))])
    lp(None, final, "lm_head", fb, aux_hidden_states=torch.cat(aux, -1))  # [N, k*H], as some models return
    writer.close()
    check_shard(tmp_path / "capture" / "packed.safetensors", 3, 4)


def test_plugin_glue_fails_a_request_whose_prefix_came_from_a_cache(glue, tmp_path):
    runtime, lp, runner, writer = glue
    forward(runtime, lp, runner, [fake_req("cached", 6)], [2], [4], [(0, range(2, 6))])
    writer.close()
    receipt = read_receipt(tmp_path, "cached")
    assert receipt["status"] == 422 and "were not computed" in receipt["message"]
    assert not list(contract.iter_shard_paths(tmp_path / "capture"))


def test_plugin_glue_fails_the_batch_when_rows_do_not_add_up(glue, tmp_path):
    _runtime, lp, runner, writer = glue
    batch = SimpleNamespace(reqs=[fake_req("p", 3)], prefix_lens=[0], extend_lens=[3])
    fb = FakeForwardBatch(EXTEND, [0], [3], ["p"])
    plugin._after_init_new(fb, "cls", batch, runner)
    final, aux = flatten([(0, range(4))])  # one padded row
    lp(None, final, "lm_head", fb, aux)
    writer.close()
    assert read_receipt(tmp_path, "p")["status"] == 500


def test_plugin_glue_fails_loudly_when_a_forward_does_not_match_its_batch(glue, tmp_path):
    _runtime, lp, runner, writer = glue
    batch = SimpleNamespace(reqs=[fake_req("s", 3)], prefix_lens=[0], extend_lens=[3])
    plugin._after_init_new(FakeForwardBatch(EXTEND, [0], [3], ["s"]), "cls", batch, runner)
    forward(_runtime, lp, runner, [fake_req("t", 2)], [0], [2], [(1, range(2))])  # s never reached the logits
    plugin._after_init_new(FakeForwardBatch(EXTEND, [0], [2], ["u"]), "cls",
                           SimpleNamespace(reqs=[fake_req("u", 2)], prefix_lens=[0], extend_lens=[2]), runner)
    final, aux = flatten([(2, range(2))])
    lp(None, final, "lm_head", FakeForwardBatch(EXTEND, [0], [2], ["other"]), aux)
    writer.close()
    assert "never reached the logits processor" in read_receipt(tmp_path, "s")["message"]
    assert "differ from the scheduled batch" in read_receipt(tmp_path, "u")["message"]
    check_shard(tmp_path / "capture" / "t.safetensors", 1, 2)


def run_hold(outs, tmp_path, rid="r", receipt=None):
    cfg = CaptureConfig(capture_dir=tmp_path / "capture", receipt_dir=tmp_path / "receipts", receipt_timeout_s=5)
    cfg.receipt_dir.mkdir(parents=True, exist_ok=True)
    if receipt is not None:
        write_receipt(cfg.receipt_dir, rid, receipt)

    async def original(manager, obj, request=None):
        for out in outs:
            yield out

    async def collect():
        gen = plugin._around_wait_one_response(original, SimpleNamespace(is_generation=True),
                                               SimpleNamespace(rid=rid), None)
        return [o async for o in gen]

    old = plugin._http_config
    plugin._http_config = cfg
    try:
        return asyncio.run(collect())
    finally:
        plugin._http_config = old


def test_http_hold_adds_the_receipt_to_the_final_answer(tmp_path):
    outs = [{"meta_info": {"finish_reason": None}}, {"meta_info": {"finish_reason": {"type": "length"}}}]
    got = run_hold(outs, tmp_path, receipt={"ok": True, "shard": "r.safetensors", "num_tokens": 3})
    assert "capture" not in got[0]["meta_info"]
    assert got[1]["meta_info"]["capture"] == {"shard": "r.safetensors", "num_tokens": 3}


def test_http_hold_turns_a_failed_capture_into_its_status(tmp_path):
    outs = [{"meta_info": {"finish_reason": {"type": "length"}}}]
    with pytest.raises(plugin.CaptureFailed) as e:
        run_hold(outs, tmp_path, receipt={"ok": False, "status": 507, "kind": "disk_full", "message": "full"})
    assert e.value.status_code == 507 and "disk_full" in str(e.value)


def test_http_hold_passes_aborts_and_no_capture_requests_straight_through(tmp_path):
    abort = [{"meta_info": {"finish_reason": {"type": "abort", "message": "x"}}}]
    assert run_hold(abort, tmp_path) == abort  # no receipt, no wait
    plain = [{"meta_info": {"finish_reason": {"type": "length"}}}]
    assert run_hold(plain, tmp_path, rid="nocapture:x") == plain


def test_model_info_block_reads_the_writer_provenance(tmp_path):
    cfg = CaptureConfig(capture_dir=tmp_path / "capture", receipt_dir=tmp_path, aux_layer_ids=IDS)
    assert plugin.capture_block(cfg)["provenance"] is None
    (tmp_path / "provenance.json").write_text(provenance().to_json())
    block = plugin.capture_block(cfg)
    assert block["enabled"] and block["hidden_size"] == H and block["aux_layer_ids"] == list(IDS)
    assert contract.Provenance.from_json(block["provenance"]) == provenance()


def test_register_is_inert_without_configuration(monkeypatch):
    monkeypatch.delenv("EAGLENEST_CAPTURE_DIR", raising=False)
    monkeypatch.delenv(engines.ENV_PROBE_DRAFT_DIR, raising=False)
    plugin.register()  # sglang is not installed here: any import of it would raise
