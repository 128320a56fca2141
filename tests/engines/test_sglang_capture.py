"""The SGLang capture plugin's GPU-free core, driven with fake SGLang batch metadata on the CPU: row plans, the
coalescer of prefill chunks, the shard writer with its receipts, and the capture configuration. (The plugin glue
and the HTTP hold: test_sglang_plugin.py.)
"""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
import torch

from eaglenest import contract
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
from tests.sglang_capture_helpers import H, check_shard, flatten, provenance, read_receipt, rows_for


def view(rid, prefix, extend, prompt, capture=True):
    return ReqView(rid, prefix, extend, prompt, capture, list(range(100, 100 + prompt)) if capture else None)


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
