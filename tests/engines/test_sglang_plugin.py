"""The SGLang capture plugin's glue, driven with fake SGLang objects on the CPU: batch views, the wrapped logits
processor, copier, writer and receipts run as in a scheduler, minus the GPU; the HTTP hold adds each receipt to
its answer; the model-info block and an unconfigured register.
"""

from __future__ import annotations

import asyncio
import sys
import types
from types import SimpleNamespace

import pytest
import torch

from eaglenest import contract, engines
from eaglenest.engines import sglang_plugin as plugin
from eaglenest.engines.sglang_capture import CaptureConfig, CaptureWriter
from eaglenest.engines.sglang_receipts import wait_for_receipt, write_receipt
from eaglenest.engines.sglang_staging import ProcessWriter
from tests.sglang_capture_helpers import (
    EXTEND,
    IDS,
    FakeForwardBatch,
    H,
    check_shard,
    fake_req,
    flatten,
    forward,
    logits_processor,
    provenance,
    read_receipt,
)


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


def _fake_sglang(monkeypatch, version: str) -> list[tuple]:
    """sglang's plugin registry and version as modules that record what register() hooks."""
    hooked: list[tuple] = []
    registry = types.ModuleType("sglang.srt.plugins.hook_registry")
    registry.HookType = types.SimpleNamespace(AFTER="after", AROUND="around")
    registry.HookRegistry = types.SimpleNamespace(register=lambda target, hook, kind: hooked.append((target, hook,
                                                                                                    kind)))
    for name in ("sglang", "sglang.srt", "sglang.srt.plugins"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "sglang.srt.plugins.hook_registry", registry)
    monkeypatch.setitem(sys.modules, "sglang.version", types.SimpleNamespace(__version__=version))
    return hooked


def test_register_hooks_the_verify_kernel_in_schedulers_only(monkeypatch):
    from eaglenest.engines.sglang_compat import SUPPORTED_SGLANG_VERSIONS

    monkeypatch.delenv("EAGLENEST_CAPTURE_DIR", raising=False)
    monkeypatch.delenv(engines.ENV_PROBE_DRAFT_DIR, raising=False)
    monkeypatch.delenv(engines.ENV_PROFILE_DIR, raising=False)
    hooked = _fake_sglang(monkeypatch, SUPPORTED_SGLANG_VERSIONS[0])
    monkeypatch.setenv(engines.ENV_VERIFY_KERNEL, "splitkv")
    monkeypatch.setattr(plugin.multiprocessing, "parent_process", lambda: object())  # a scheduler process
    plugin.register()
    assert hooked == [(plugin.T_RUNNER, plugin._install_verify_kernel, "after")]
    hooked.clear()
    monkeypatch.setattr(plugin.multiprocessing, "parent_process", lambda: None)  # the HTTP process builds no runner
    plugin.register()
    assert hooked == []
    monkeypatch.setenv(engines.ENV_VERIFY_KERNEL, "sglang")  # SGLang's own kernel: nothing to hook
    monkeypatch.setattr(plugin.multiprocessing, "parent_process", lambda: object())
    plugin.register()
    assert hooked == []
    monkeypatch.setenv(engines.ENV_VERIFY_KERNEL, "flash")
    with pytest.raises(SystemExit, match="EAGLENEST_VERIFY_KERNEL='flash': expected one of sglang, splitkv"):
        plugin.register()
