from eaglenest.extraction.ledger import Ledger, LedgerEntry, mask_to_spans, spans_to_mask


def entry(i: int, **over) -> LedgerEntry:
    base = dict(sample_id=f"s{i}", shard=f"s{i}.safetensors", sha256="0" * 64, bytes=10, num_tokens=6,
                loss_tokens=3, loss_spans=((2, 4), (5, 6)))
    base.update(over)
    return LedgerEntry(**base)


def test_mask_spans_round_trip():
    mask = [0, 1, 1, 0, 0, 1, 1, 1]
    assert mask_to_spans(mask) == ((1, 3), (5, 8))
    assert spans_to_mask(mask_to_spans(mask), len(mask)) == mask
    assert entry(0).loss_mask() == [0, 0, 1, 1, 0, 1]


def test_append_and_reload(tmp_path):
    led = Ledger(tmp_path)
    assert led.entries() == {}
    led.append([entry(0), entry(1)])
    led.append([entry(1, bytes=99)])
    got = Ledger(tmp_path).entries()
    assert set(got) == {"s0", "s1"} and got["s1"].bytes == 99


def test_torn_last_line_is_ignored_and_repaired(tmp_path):
    led = Ledger(tmp_path)
    led.append([entry(0)])
    with open(led.path, "a") as f:
        f.write(entry(1).to_json()[:25])  # a crash mid-append
    assert set(led.entries()) == {"s0"}
    led.append([entry(2)])
    assert set(led.entries()) == {"s0", "s2"}


def test_jsonl_log_never_fsyncs_on_the_writers_thread(tmp_path, monkeypatch):
    """The answers log is written from the extraction's event loop: a slow fsync there (seconds, under heavy
    shard writes) would stop every request. Writes return after the OS has the bytes; a thread of the log's
    own fsyncs them, and close() leaves everything fsynced."""
    import os
    import threading

    from eaglenest.extraction.state import JsonlLog

    synced, gate, closing = [], threading.Event(), threading.Event()
    me = threading.current_thread()

    def slow_fsync(fd):
        if threading.current_thread() is me and not closing.is_set():
            raise AssertionError("fsync on the writer's thread")
        synced.append((threading.current_thread() is me, os.fstat(fd).st_size))
        gate.wait(5)  # an fsync that takes as long as the test lets it

    monkeypatch.setattr(os, "fsync", slow_fsync)
    log = JsonlLog(tmp_path / "a.jsonl", fsync_s=0.0)
    for i in range(50):  # the first fsync is stuck: every write still returns
        log.write([{"i": i}])
    assert (tmp_path / "a.jsonl").read_text().count("\n") == 50  # each write reached the OS at once
    gate.set()
    closing.set()
    log.close()
    assert synced and not any(mine for mine, _ in synced[:-1])  # the log's thread synced while writing
    assert synced[-1] == (True, (tmp_path / "a.jsonl").stat().st_size)  # close() synced everything written
    assert [d["i"] for d in JsonlLog.read(tmp_path / "a.jsonl")] == list(range(50))
