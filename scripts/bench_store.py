"""Benchmark the store: P3 conversion speed vs `cp`, P4 random vs file-order reads, zero-copy proof.

    python scripts/bench_store.py [--gb 1.0] [--hidden 576] [--workdir /tmp] [--repeats 2]

Builds a fake extraction (real shards + ledger, random bf16 states, 3 aux layers, lengths 100..900) of
about --gb GB in --workdir, then prints:
- P3 = convert MB/s / cp MB/s over the same shard bytes on the same disk. `cp --reflink=never` followed
  by `sync` of the copies vs `eaglenest.store.convert` (which re-hashes every shard, decodes it, writes
  and fsyncs Arrow files and hashes them for the manifest). Input in page cache for both; best of repeats.
- P4 = random-order / file-order sample read MB/s, read in batches of 8 through StoreDataset (as a
  DataLoader with a batch sampler does: the batch is prefetched, then read), every byte consumed (copied
  into a reused buffer), cold (store pages evicted with posix_fadvise(DONTNEED) before each pass, read through a freshly
  opened Store) and warm; best of --repeats passes each.
- zero copies: the same sample read twice has the same data pointer, inside the file's memory map;
  anonymous RSS (RssAnon) barely moves while every byte of the store is read.
- sha256 check: first-read MB/s of a cold store (random order, fresh Store per pass) with the per-file sha256
  check on first read (the default) and without it (``check_sha256=False``).
- encodings: conversion MB/s (shard bytes in / wall seconds, best of repeats) and bytes per token of the same
  extraction converted as bf16 and as fp8, alternately (``--device`` says where fp8 is encoded).
``--sections`` picks what runs (default all: p3,p4,sha,enc).
Numbers on a shared 2-core machine are noisy: rerun when the machine is quiet.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from eaglenest.extraction.ledger import Ledger
from eaglenest.store import StoreDataset, convert, open_store
from eaglenest.testing.fake_store import add_samples, fake_provenance, fake_shard


def rss_anon_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def evict(paths) -> None:
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def build(ex: Path, gb: float, hidden: int, seed: int) -> int:
    prov = fake_provenance(hidden_size=hidden, aux_layer_ids=(1, 14, 26), num_layers=30)
    rng = random.Random(seed)
    per_token = 4 * hidden * 2 + 4
    total, i, batch = 0, 0, []
    while total < gb * 1e9:
        t = rng.randint(100, 900)
        batch.append(fake_shard(f"s{i:06d}", t, prov, seed=i))
        total += t * per_token
        i += 1
        if len(batch) == 64:
            add_samples(ex, batch, seed=i)
            batch = []
    if batch:
        add_samples(ex, batch, seed=i)
    return sum(e.bytes for e in Ledger(ex).entries().values())


def time_cp(src: Path, dst: Path) -> float:
    shutil.rmtree(dst, ignore_errors=True)
    dst.mkdir(parents=True)
    files = sorted(str(p) for p in src.iterdir())
    t0 = time.perf_counter()
    subprocess.run(["cp", "--reflink=never", *files, str(dst)], check=True)
    subprocess.run(["sync", *[str(dst / Path(f).name) for f in files]], check=True)
    return time.perf_counter() - t0


BATCH = 8


def read_pass(store, order, out: torch.Tensor) -> float:
    """Read samples in ``order`` the way a DataLoader with a batch sampler does (StoreDataset.__getitems__,
    BATCH samples at a time) and consume every byte."""
    ds = StoreDataset(store)
    t0 = time.perf_counter()
    for k in range(0, len(order), BATCH):
        for s in ds.__getitems__(order[k : k + BATCH]):
            for t in (s.input_ids, s.aux_hidden, s.final_hidden):
                flat = t.reshape(-1).view(torch.uint8)
                out[: flat.numel()].copy_(flat)
    return time.perf_counter() - t0


def first_read(url: str, files, order, out: torch.Tensor, *, check: bool, cold: bool) -> float:
    """Seconds to read every sample once through a fresh Store that has not checked its files yet (the
    verified-file memo is cleared); cold: the store's pages are evicted first."""
    from eaglenest.store import reader

    reader._CHECKED.clear()
    if cold:
        evict(files)
    return read_pass(open_store(url, check_sha256=check), order, out)


def compare_encodings(ex: Path, work: Path, shard_bytes: int, args) -> None:
    best, summary = {"bf16": float("inf"), "fp8": float("inf")}, {}
    for _ in range(args.repeats):
        for enc in best:  # alternated, so that a busy neighbour slows both alike
            shutil.rmtree(work / f"store-{enc}", ignore_errors=True)
            summary[enc] = convert(ex, str(work / f"store-{enc}"), target_file_bytes=args.target_file_mb << 20,
                                   encoding=enc, device=args.device)
            best[enc] = min(best[enc], summary[enc].seconds)
    res = {}
    for enc, s in summary.items():
        res[enc] = (shard_bytes / best[enc] / 1e6, s.store_bytes / s.tokens)
        shutil.rmtree(work / f"store-{enc}")
        print(f"  {enc}: convert {res[enc][0]:.0f} MB/s (input), {res[enc][1]:.1f} bytes/token")
    print(f"encodings: fp8/bf16 conversion speed {res['fp8'][0] / res['bf16'][0]:.2f} (goal >= 1), "
          f"bytes per token {res['fp8'][1] / res['bf16'][1]:.3f} (goal <= 0.52)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gb", type=float, default=1.0)
    ap.add_argument("--hidden", type=int, default=576)
    ap.add_argument("--workdir", default=None, help="folder on the disk to measure (default: a temp dir in /tmp)")
    ap.add_argument("--target-file-mb", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--keep", action="store_true", help="keep the work folder")
    ap.add_argument("--sections", default="p3,p4,sha,enc", help="comma-separated: p3, p4, sha, enc")
    ap.add_argument("--device", default="auto", help="enc: where fp8 encoding runs (auto | cpu | cuda)")
    args = ap.parse_args()
    sections = set(args.sections.split(","))
    work = Path(tempfile.mkdtemp(prefix="bench-store-", dir=args.workdir))
    try:
        ex = work / "ex"
        t0 = time.perf_counter()
        shard_bytes = build(ex, args.gb, args.hidden, seed=0)
        n = len(Ledger(ex).entries())
        print(f"fake extraction: {n} samples, {shard_bytes / 1e6:.0f} MB of shards, H={args.hidden}, "
              f"built in {time.perf_counter() - t0:.0f} s; workdir {work}")

        cp_s, conv_s = [], []
        for r in range(args.repeats if "p3" in sections else 0):
            cp_s.append(time_cp(ex / "capture", work / "cp"))
            shutil.rmtree(work / "cp")
            shutil.rmtree(work / "store", ignore_errors=True)
            summary = convert(ex, str(work / "store"), target_file_bytes=args.target_file_mb << 20)
            conv_s.append(summary.seconds)
            print(f"  round {r}: cp {shard_bytes / cp_s[-1] / 1e6:.0f} MB/s, convert "
                  f"{shard_bytes / conv_s[-1] / 1e6:.0f} MB/s ({summary.files_written} files)")
        if "p3" in sections:
            cp_mbs, conv_mbs = shard_bytes / min(cp_s) / 1e6, shard_bytes / min(conv_s) / 1e6
            print(f"P3 conversion {conv_mbs:.0f} MB/s / cp {cp_mbs:.0f} MB/s = {conv_mbs / cp_mbs:.3f} "
                  "(target >= 0.8)")
        else:
            convert(ex, str(work / "store"), target_file_bytes=args.target_file_mb << 20)

        if "enc" in sections:
            compare_encodings(ex, work, shard_bytes, args)
        store = open_store(str(work / "store"))
        files = store._paths
        nbytes = sum(f["bytes"] for f in store.manifest["files"])
        biggest = int(store.num_tokens.max()) * 4 * args.hidden * 2
        out = torch.empty(biggest, dtype=torch.uint8)
        file_order = sorted(range(len(store)), key=lambda i: (store._file[i], store._offset[i]))
        rand_order = file_order[:]
        random.Random(1).shuffle(rand_order)
        for cold in (True, False) if "sha" in sections else ():
            mbs = {check: nbytes / min(first_read(str(work / "store"), files, rand_order, out, check=check, cold=cold)
                                       for _ in range(args.repeats)) / 1e6 for check in (True, False)}
            print(f"sha256 check: first read ({'cold' if cold else 'warm'}, random order) {mbs[True]:.0f} MB/s "
                  f"with the check, {mbs[False]:.0f} MB/s without = {mbs[True] / mbs[False]:.2f}")
        if "p4" not in sections:
            return
        rss0 = rss_anon_mb()
        for cold in (True, False):
            res = {}
            for name, order in (("file", file_order), ("random", rand_order)):
                best = float("inf")
                for _ in range(args.repeats):
                    if cold:  # a fresh Store: pages mapped by a live Store cannot be evicted
                        reader = None
                        evict(files)
                        reader = open_store(str(work / "store"))
                    else:
                        reader = store
                        read_pass(reader, order, out)
                    best = min(best, read_pass(reader, order, out))
                res[name] = nbytes / best / 1e6
            label = "cold" if cold else "warm"
            print(f"P4 {label}: random {res['random']:.0f} MB/s / file-order {res['file']:.0f} MB/s = "
                  f"{res['random'] / res['file']:.2f} (target >= 0.9)")
        rss1 = rss_anon_mb()
        a, b = store[0], store[0]
        mm_base = store._mapped(int(store._file[0]))[1].data_ptr()
        mm_len = store.manifest["files"][int(store._file[0])]["bytes"]
        inside = mm_base <= a.aux_hidden.data_ptr() < mm_base + mm_len
        print(f"zero copy: same pointer twice {a.aux_hidden.data_ptr() == b.aux_hidden.data_ptr()}, "
              f"inside the file's mmap {inside}; RssAnon {rss0:.0f} -> {rss1:.0f} MB while reading "
              f"{2 * 2 * args.repeats * nbytes / 1e9:.1f} GB")
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
