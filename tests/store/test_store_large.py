"""One sample with more than 2^31 values in a column, written sparsely (holes) so the test stays cheap.

The converter writes samples through exactly these functions (layout.sample_batch, IPC_OPTIONS with
allow_64bit, first_batch_offset) and the reader reads them through layout.batch_tensors.
"""

from __future__ import annotations

import mmap
import os
import resource

import numpy as np
import pyarrow as pa
import pytest
import torch

from eaglenest.store import layout as L
from eaglenest.testing.fake_store import fake_provenance


class SparseSink:
    """Writes non-zero 1 MiB blocks, seeks over zero ones: the file gets holes instead of bytes."""

    def __init__(self, path):
        self.f = open(path, "wb")  # noqa: SIM115
        self.pos = 0
        self.closed = False

    def write(self, data):
        view = memoryview(data).cast("B")
        step = 1 << 20
        for s in range(0, view.nbytes, step):
            chunk = view[s : s + step]
            if np.frombuffer(chunk, dtype=np.uint8).any():
                self.f.seek(self.pos + s)
                self.f.write(chunk)
        self.pos += view.nbytes
        return view.nbytes

    def tell(self):
        return self.pos

    def flush(self):
        pass

    def close(self):
        self.f.truncate(self.pos)
        self.f.close()
        self.closed = True


def test_sample_with_more_than_2_31_values_round_trips(tmp_path):
    prov = fake_provenance(hidden_size=4096, aux_layer_ids=range(8), num_layers=10)  # k*H = 32768
    t = 65_537  # aux_hidden: 65537 * 32768 = 2^31 + 32768 values (4 GiB), final_hidden 512 MiB
    kh, h = 8 * 4096, 4096
    probe_aux = [0, 2**31 - 1, 2**31 + 5, t * kh - 1]
    probe_final = [0, t * h - 1]
    bits_aux = np.zeros(t * kh, dtype=np.uint16)  # calloc: pages stay untouched (zero page) until written
    bits_final = np.zeros(t * h, dtype=np.uint16)
    for j, p in enumerate(probe_aux):
        bits_aux[p] = 0x3F80 + j  # bf16 1.0, 1.0078125, ...
    for j, p in enumerate(probe_final):
        bits_final[p] = 0x4000 + j
    ids = torch.arange(t, dtype=torch.int32)
    mask = torch.zeros(t, dtype=torch.bool)
    mask[-1] = True
    aux = torch.from_numpy(bits_aux).view(torch.bfloat16).view(t, kh)  # [T, kH]
    final = torch.from_numpy(bits_final).view(torch.bfloat16).view(t, h)  # [T, H]
    assert aux.numel() > 2**31
    schema = L.data_schema(prov)
    path = tmp_path / "big.arrow"
    sink = SparseSink(path)
    with pa.ipc.new_file(pa.PythonFile(sink, mode="w"), schema, options=L.IPC_OPTIONS) as w:
        start = L.first_batch_offset(schema)
        w.write_batch(L.sample_batch(schema, [ids, mask, aux, final]))
        end = sink.tell()
    del bits_aux, bits_final, aux, final
    assert end - start > 2**32
    assert os.stat(path).st_blocks * 512 < 64 << 20  # sparse: the test wrote little real data

    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with open(path, "rb") as f:
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    base = torch.frombuffer(mm, dtype=torch.uint8)
    buf = pa.py_buffer(mm)
    batch = pa.ipc.read_record_batch(pa.ipc.read_message(buf.slice(start, end - start)), schema)
    cols = L.batch_tensors(batch, base, buf.address)
    r_ids, r_mask, r_aux, r_final = (cols[n] for n in ("input_ids", "loss_mask", "aux_hidden", "final_hidden"))
    assert r_aux.shape == (t, kh) and r_final.shape == (t, h)
    flat_aux, flat_final = r_aux.view(-1).view(torch.int16), r_final.view(-1).view(torch.int16)
    assert [int(flat_aux[p]) for p in probe_aux] == [0x3F80 + j for j in range(len(probe_aux))]
    assert [int(flat_final[p]) for p in probe_final] == [0x4000 + j for j in range(len(probe_final))]
    assert int(flat_aux[2**31 + 4]) == 0 and torch.equal(r_ids[-3:], ids[-3:]) and bool(r_mask[-1])
    assert r_aux.data_ptr() - base.data_ptr() < os.path.getsize(path)  # a view of the map, not a copy
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss0 < 256 << 10  # KiB: no 4 GiB copy
    with pytest.raises(pa.ArrowCapacityError):  # without allow_64bit Arrow refuses the column: the option matters
        pa.ipc.new_file(pa.BufferOutputStream(), schema).write_batch(batch)
