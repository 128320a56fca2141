"""The store on real object storage: a local S3 endpoint (moto's server, its own process) through s3fs.

What runs against S3 here is what a user runs: ``store convert`` writes data files, sidecars, index and
the manifest LAST as S3 objects; ``store verify`` / ``store info`` read them back over HTTP; training
reads batches through :class:`StoreDataset` with one range request per sample; an upload interrupted
by an exception (mid multipart upload) leaves no visible version and no dangling multipart upload.

Needs the ``s3`` extra (s3fs) and moto's server (``moto[server]``, a test dependency); the module is
skipped, saying which is missing, without them. Credentials are moto's dummy keys from the environment
(never parameters), and the endpoint comes from AWS_ENDPOINT_URL_S3, as a user points s3fs at MinIO.
"""

from __future__ import annotations

import importlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import uuid

import httpx
import pytest
import torch
from typer.testing import CliRunner

from eaglenest.atomic import TMP_SUFFIX
from eaglenest.cli import app
from eaglenest.store import LengthBucketSampler, StoreDataset, convert, open_store, storage
from eaglenest.store import layout as L
from eaglenest.testing.fake_store import fake_provenance, make_extraction

LENGTHS = [40, 25, 60, 33, 18, 51, 47, 29, 36, 22, 58, 41]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def s3_endpoint(tmp_path_factory):
    """moto's S3 server on 127.0.0.1 in its own process group, and the environment that points s3fs at it."""
    pytest.importorskip("s3fs", reason="the s3 extra is not installed (pip install 'eaglenest[s3]')")
    pytest.importorskip("moto.server", reason="moto's S3 server is not installed (pip install 'moto[server]')")
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    env = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1",
           "AWS_ENDPOINT_URL_S3": url}
    log = tmp_path_factory.mktemp("moto") / "server.log"
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                            env={**os.environ, **env}, stdout=log.open("wb"), stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
        deadline = time.monotonic() + 30
        while True:
            assert proc.poll() is None, "moto server exited:\n" + log.read_text(errors="replace")[-3000:]
            try:
                if httpx.get(f"{url}/moto-api/", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "moto server not ready in 30 s:\n" + log.read_text()[-3000:]
            time.sleep(0.1)
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            yield url
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
    finally:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=10)
        except ProcessLookupError:
            pass
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)


@pytest.fixture
def bucket(s3_endpoint):
    """A fresh bucket, and a boto3 client that sees the endpoint without any s3fs listing cache."""
    import boto3

    name = f"eaglenest-{uuid.uuid4().hex[:12]}"
    client = boto3.client("s3", endpoint_url=s3_endpoint)
    client.create_bucket(Bucket=name)
    return name, client


def _keys(client, bucket: str) -> list[str]:
    pages = client.get_paginator("list_objects_v2").paginate(Bucket=bucket)
    return sorted(o["Key"] for page in pages for o in page.get("Contents", []))


def test_convert_verify_info_and_train_reads_on_s3(tmp_path, bucket):
    """convert to s3://, then verify and info through the CLI (a separate process, S3 over HTTP); every
    sample read back equals the local store's; a few training batches come through StoreDataset."""
    name, client = bucket
    make_extraction(tmp_path / "ex", LENGTHS)
    url = f"s3://{name}/runs/store"
    summary = convert(tmp_path / "ex", url, target_file_bytes=20_000)
    assert summary.samples == len(LENGTHS) and summary.files_written == summary.files_total > 1
    keys = _keys(client, name)
    manifest_key = f"runs/store/{L.VERSIONS_DIR}/{summary.version}/{L.MANIFEST_NAME}"
    data = [k for k in keys if k.startswith(f"runs/store/{L.DATA_DIR}/") and k.endswith(L.DATA_SUFFIX)]
    assert manifest_key in keys and len(data) == summary.files_total
    assert not [k for k in keys if k.endswith(TMP_SUFFIX) or ".tmp" in k]  # transactions, no temporaries

    verified = CliRunner().invoke(app, ["store", "verify", url])  # reads every byte back over HTTP
    assert verified.exit_code == 0 and verified.stdout.startswith(f"OK {url} version {summary.version}"), (
        verified.output)

    remote = open_store(url, verify=True)
    assert remote.info()["samples"] == len(LENGTHS) and remote.info()["files"] == summary.files_total
    local = open_store(str(convert(tmp_path / "ex", tmp_path / "local", target_file_bytes=20_000).url))
    assert remote.manifest["files"] == local.manifest["files"]  # same bytes, same sha256, on both backends
    for i in range(len(local)):
        a, b = remote[i], local[i]
        assert a.sample_id == b.sample_id and torch.equal(a.input_ids, b.input_ids)
        assert torch.equal(a.aux_hidden.view(torch.int16), b.aux_hidden.view(torch.int16))
        assert torch.equal(a.final_hidden.view(torch.int16), b.final_hidden.view(torch.int16))
        assert torch.equal(a.loss_mask, b.loss_mask)

    ds = StoreDataset(remote)
    sampler = LengthBucketSampler(ds.lengths, max_tokens=128, shuffle=True, seed=3)
    loader = torch.utils.data.DataLoader(ds, batch_sampler=sampler, collate_fn=lambda samples: samples)
    seen = []
    for batch_indices, batch in zip(sampler.epoch_batches(0), loader, strict=True):
        assert sum(len(s.input_ids) for s in batch) <= 128 or len(batch) == 1
        for j, s in zip(batch_indices, batch, strict=True):
            assert s.sample_id == local[j].sample_id
            assert torch.equal(s.final_hidden.view(torch.int16), local[j].final_hidden.view(torch.int16))
        seen += [s.sample_id for s in batch]
        if len(seen) >= 3 * 2:
            break
    assert len(seen) >= 6 and len(set(seen)) == len(seen)


def test_interrupted_multipart_upload_publishes_no_version(tmp_path, bucket, monkeypatch):
    """An exception in the middle of a data file's multipart upload (5 MiB parts already sent): the finished
    files are complete objects, no version exists, no multipart upload is left open; the re-run reuses the
    finished files and commits."""
    name, client = bucket
    prov = fake_provenance(hidden_size=512)  # 4 KiB per token: two data files of ~6.5 MiB
    make_extraction(tmp_path / "ex", [400] * 8, provenance=prov)
    url = f"s3://{name}/store"
    opts = {"default_block_size": 5 << 20}  # multipart from the first 5 MiB (the S3 minimum part size)
    real = storage.HashingWriter.write
    writers: list[storage.HashingWriter] = []  # the objects themselves: an id() may be reused once one is freed

    def failing(self, data):
        if not any(w is self for w in writers):
            writers.append(self)
        if writers[-1] is self and len(writers) >= 3 and self.size > (5 << 20) + (512 << 10):
            raise ConnectionError("upload interrupted")  # mid 2nd data file (after file 1 and its sidecar)
        return real(self, data)

    monkeypatch.setattr(storage.HashingWriter, "write", failing)
    with pytest.raises(ConnectionError):
        convert(tmp_path / "ex", url, target_file_bytes=6 << 20, storage_options=opts)
    assert len(writers) == 3  # the failure happened in the second data file
    keys = _keys(client, name)
    data = [k for k in keys if k.startswith(f"store/{L.DATA_DIR}/") and k.endswith(L.DATA_SUFFIX)]
    assert len(data) == 1 and not [k for k in keys if f"/{L.VERSIONS_DIR}/" in k], keys
    assert not client.list_multipart_uploads(Bucket=name).get("Uploads")  # the started upload was aborted
    side = json.loads(client.get_object(Bucket=name, Key=data[0] + L.SIDECAR_SUFFIX)["Body"].read())
    body = client.get_object(Bucket=name, Key=data[0])["Body"].read()
    assert len(body) == side["bytes"] > 5 << 20  # the finished file is complete (multipart, committed)
    with pytest.raises(L.StoreNotFound):
        open_store(url, storage_options=opts)

    monkeypatch.undo()
    again = convert(tmp_path / "ex", url, target_file_bytes=6 << 20, storage_options=opts)
    assert again.files_reused == 1 and again.files_written == again.files_total - 1
    assert open_store(url, storage_options=opts).verify() == []


def test_store_info_without_s3fs_names_the_extra(monkeypatch):
    """No s3fs installed (hidden from fsspec's registry and imports): one clear line naming the extra."""
    registry = importlib.import_module("fsspec.registry")  # the module (fsspec.registry is also a mapping)
    monkeypatch.delitem(registry._registry, "s3", raising=False)
    monkeypatch.setitem(sys.modules, "s3fs", None)  # import s3fs -> ImportError, as without the package
    result = CliRunner().invoke(app, ["store", "info", "s3://bucket/store"])
    assert result.exit_code == 2 and isinstance(result.exception, SystemExit), result.output
    lines = [x for x in result.stderr.splitlines() if x.strip()]
    assert lines == ["error: s3://bucket/store: s3:// needs s3fs, which is not installed: "
                     "pip install 'eaglenest[s3]'"], result.stderr
