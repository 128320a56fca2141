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
