"""The skinny bf16 linear: x @ w.T to bf16 rounding, each row independent of the others (bit for bit),
and used by the decoders' linears inside a decoding phase only."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F

from eaglenest.speculative import kernels, onednn


@pytest.fixture(scope="module")
def skinny():
    f = kernels.skinny_linear()
    if f is None:
        pytest.skip("skinny kernel unavailable here (no AVX512-BF16 or no compiler)")
    return f


@pytest.mark.parametrize(("m", "n", "k"), [(1, 960, 576), (4, 3072, 576), (5, 576, 1536), (7, 64, 40), (16, 8, 100),
                                         (16, 192, 96), (2, 64, 32), (3, 68, 64)])
@pytest.mark.parametrize("path", ["default", "amx"])
def test_skinny_is_x_times_w_transposed_and_rows_do_not_interact(skinny, m, n, k, path):
    """On either path of the kernel (AVX512, and AMX where the CPU has it)."""
    g = torch.Generator().manual_seed(m * n + k)
    x, w = (torch.randn(*s, generator=g).to(torch.bfloat16) for s in ((m, k), (n, k)))
    with kernels.amx() if path == "amx" else contextlib.nullcontext():
        y = skinny(x, w)
        assert y.shape == (m, n) and y.dtype == torch.bfloat16
        torch.testing.assert_close(y.float(), x.float() @ w.float().T, rtol=1e-2, atol=1e-2 * k ** 0.5)
        for i in range(m):  # a verify row gets exactly what a 1-row step gets
            assert torch.equal(skinny(x[i: i + 1].contiguous(), w)[0], y[i])


def test_a_build_killed_midway_does_not_stall_the_next_process(skinny, tmp_path):
    """A killed build leaves torch's lock file, on which torch waits forever; the next process removes it."""
    import subprocess
    import sys

    stale = kernels.build_dir() / "lock"
    stale.write_text("")
    code = "from eaglenest.speculative import kernels; import sys; sys.exit(kernels.skinny_linear() is None)"
    try:
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240)
    finally:
        was_left = stale.exists()
        stale.unlink(missing_ok=True)
    assert done.returncode == 0 and not was_left, done.stderr[-2000:]
    assert "left by a build that was killed" in done.stderr


def test_amx_block_restores_the_kernel_path(skinny):
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(4, 576, generator=g).to(torch.bfloat16), torch.randn(49152, 576, generator=g).to(torch.bfloat16)
    before = skinny(x, w)
    with kernels.amx():
        skinny(x, w)
    assert torch.equal(skinny(x, w), before)


@pytest.mark.parametrize(("m", "n", "k"), [(1, 960, 576), (3, 16000, 576), (4, 576, 6144), (5, 8, 100), (16, 12, 40)])
def test_int8_skinny_is_x_times_the_dequantized_weight(m, n, k):
    """int8 weights with a scale per row: the product of x and the dequantized weight; rows independent."""
    from eaglenest.speculative.quant import quantize_rows

    f = kernels.skinny_linear_i8()
    if f is None:
        pytest.skip("skinny kernel unavailable here (no AVX512-BF16 or no compiler)")
    g = torch.Generator().manual_seed(m * n + k)
    x, w = torch.randn(m, k, generator=g).to(torch.bfloat16), torch.randn(n, k, generator=g) * 0.05
    q, scale = quantize_rows(w)
    assert q.dtype == torch.int8 and int(q.abs().max()) == 127 and scale.shape == (n,)
    deq = q.float() * scale[:, None]
    assert float((deq - w).abs().max()) <= float(scale.max()) / 2 + 1e-7  # rounding to the nearest level
    y = f(x, q, scale)
    assert y.shape == (m, n) and y.dtype == torch.bfloat16
    torch.testing.assert_close(y.float(), x.float() @ deq.T, rtol=1e-2, atol=2e-3 * k ** 0.5)
    for i in range(m):
        assert torch.equal(f(x[i: i + 1].contiguous(), q, scale)[0], y[i])
    with pytest.raises(RuntimeError, match="int8 w"):
        f(x, w.to(torch.bfloat16), scale)


@pytest.mark.parametrize("group", [32, 64, 128])
def test_q4_round_trip_is_within_half_a_step_of_each_group(group):
    """int4 in groups: each value within half its group's scale, the largest of a group at +-7 steps, the packing's
    nibble order (low: a block's first 32 values, high: its last 32) undone exactly."""
    from eaglenest.speculative.quant import dequantize_q4, quantize_q4

    g = torch.Generator().manual_seed(group)
    w = torch.randn(12, 384, generator=g) * torch.logspace(-3, 1, 12)[:, None]  # rows of very different sizes
    w[3, :group] = 0.0  # an all-zero group: scale clamped, values exactly 0
    packed, scale = quantize_q4(w, group)
    assert packed.dtype == torch.uint8 and packed.shape == (12, 192) and scale.shape == (12, 384 // group)
    assert scale.dtype == torch.bfloat16
    deq = dequantize_q4(packed, scale)
    step = scale.float().repeat_interleave(group, dim=1)  # [12, 384]: each value's group scale
    assert bool(((deq - w).abs() <= step / 2 * (1 + 1e-6)).all())
    assert not deq[3, :group].any()
    levels = (deq / step).round().abs().view(12, -1, group).amax(-1)  # [12, K/G]: each group's largest level
    live = w.view(12, -1, group).abs().amax(-1) > 0
    assert bool((levels[live] == 7).all())
    q = torch.randint(-7, 8, (4, 128), generator=g).float()
    q[:, ::64] = 7.0  # every group spans the levels: unit scales, so the levels come back exactly
    assert torch.equal(dequantize_q4(*quantize_q4(q, 64)), q)
    assert (packed[0, 0] & 15) == round(float(w[0, 0] / step[0, 0])) + 8  # value 0 in the low nibble of byte 0
    assert (packed[0, 0] >> 4) == round(float(w[0, 32] / step[0, 32])) + 8  # value 32 in its high nibble
    with pytest.raises(ValueError, match="multiple of 64"):
        quantize_q4(torch.randn(4, 96), 32)


def test_q4_refuses_what_the_kernel_cannot_take_and_names_the_linear():
    """Bad input gets an error naming the linear and what is wrong; a q4 weight the kernel cannot multiply (a group
    it does not take, rows beyond its few) says it does not fit, so the caller falls back to the dequantized one."""
    from eaglenest.speculative.quant import QuantWeight, quantize_q4

    with pytest.raises(ValueError, match="group size 96"):
        quantize_q4(torch.randn(4, 192), 96)
    with pytest.raises(ValueError, match=r"'down'.*multiple of 64.*without q4"):
        QuantWeight.of(torch.randn(8, 100), "q4", name="drafter linear 'down'")
    bad = torch.randn(8, 128)
    bad[2, 5] = float("nan")
    with pytest.raises(ValueError, match=r"'fc'.*NaN"):
        QuantWeight.of(bad, "q8", name="drafter linear 'fc'")
    good = QuantWeight.of(torch.randn(8, 128), "q4")
    x = torch.randn(2, 128).to(torch.bfloat16)
    three = QuantWeight("q4", good.data, torch.ones(8, 3, dtype=torch.bfloat16))  # 128 / 3 inputs a group: none
    assert not three.fits(x)
    assert not good.fits(torch.randn(40, 128).to(torch.bfloat16))  # more rows than the kernel's few
    if kernels.skinny_linear() is not None:
        assert good.fits(x)


@pytest.mark.parametrize(("m", "n", "k", "group"), [(1, 960, 1152, 64), (4, 576, 6144, 64), (3, 16000, 576, 64),
                                                    (5, 8, 128, 32), (8, 12, 640, 128), (16, 4, 64, 32)])
def test_q4_skinny_is_x_times_the_dequantized_weight(m, n, k, group):
    """Packed int4 weights with a scale per group: the product of x and the dequantized weight (fp32 sums, one bf16
    rounding); rows independent."""
    from eaglenest.speculative.quant import dequantize_q4, quantize_q4

    f = kernels.skinny_linear_q4()
    if f is None:
        pytest.skip("skinny kernel unavailable here (no AVX512-BF16 or no compiler)")
    g = torch.Generator().manual_seed(m * n + k + group)
    x, w = torch.randn(m, k, generator=g).to(torch.bfloat16), torch.randn(n, k, generator=g) * 0.05
    packed, scale = quantize_q4(w, group)
    y = f(x, packed, scale)
    assert y.shape == (m, n) and y.dtype == torch.bfloat16
    ref = x.float() @ dequantize_q4(packed, scale).T
    torch.testing.assert_close(y.float(), ref, rtol=8e-3, atol=1e-5 * k ** 0.5)  # bf16 rounding of the output
    for i in range(m):
        assert torch.equal(f(x[i: i + 1].contiguous(), packed, scale)[0], y[i])
    with pytest.raises(RuntimeError, match="uint8 w"):
        f(x, w.to(torch.bfloat16), scale)


def test_skinny_refuses_what_it_cannot_compute(skinny):
    w = torch.randn(8, 32).to(torch.bfloat16)
    with pytest.raises(RuntimeError, match="multiple of 4"):
        skinny(torch.randn(1, 32).to(torch.bfloat16), w[:6].contiguous())
    with pytest.raises(RuntimeError, match="bf16"):
        skinny(torch.randn(1, 32), w)
    q4, x = kernels.skinny_linear_q4(), torch.randn(1, 384).to(torch.bfloat16)
    packed, scales = torch.zeros(4, 192, dtype=torch.uint8), torch.ones(4, 2, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="groups of 32, 64 or 128"):  # groups of 192
        q4(x, packed, scales)
    with pytest.raises(RuntimeError, match="multiple of 64"):
        q4(x[:, :96].contiguous(), packed[:, :48].contiguous(), torch.ones(4, 3, dtype=torch.bfloat16))
    assert not kernels.skinny_fits(x[:, :96].contiguous(), packed[:, :48].contiguous())  # that one stays in torch


def test_linear_takes_the_kernel_inside_a_phase_only(monkeypatch):
    calls = []

    def fake(x, w):
        calls.append(tuple(x.shape))
        return F.linear(x, w)

    monkeypatch.setattr(kernels, "skinny_linear", lambda: fake)
    monkeypatch.setattr(onednn, "skinny_linear", lambda: fake)
    w = torch.randn(8, 32).to(torch.bfloat16)
    x = torch.randn(1, 3, 32).to(torch.bfloat16)
    out = onednn.linear(x, w, None)  # outside a phase: the plain F.linear (capture and generate unchanged)
    assert calls == []
    with onednn.phase(True):
        assert torch.equal(onednn.linear(x, w, None), out)
        onednn.linear(torch.randn(17, 32).to(torch.bfloat16), w, None)  # too many rows: oneDNN / F.linear
        onednn.linear(x.float(), w.float(), None)  # fp32: never the kernel
    assert calls == [(3, 32)]


def test_the_kernel_can_be_switched_off(monkeypatch):
    monkeypatch.setenv("EAGLENEST_SKINNY", "0")
    assert kernels._module.__wrapped__() is None


def _attention_reference(q, k, v, t, mask):
    """fp32 SDPA over the first ``t`` cache rows: q [S, H, hd], k/v [Hkv, capacity, hd] -> [S, H*hd]."""
    s, h, hd = q.shape
    out = F.scaled_dot_product_attention(q.transpose(0, 1)[None].float(), k[None, :, :t].float(),
                                         v[None, :, :t].float(), attn_mask=mask, enable_gqa=True)
    return out[0].transpose(0, 1).reshape(s, h * hd)


@pytest.mark.parametrize(("rows", "t"), [(1, 100), (4, 203), (3, 17), (5, 260)])
def test_decode_attention_is_sdpa_and_rows_do_not_interact(skinny, rows, t):
    attend = kernels.decode_attention()
    g = torch.Generator().manual_seed(rows * t)
    k, v = (torch.randn(3, 300, 64, generator=g).to(torch.bfloat16) for _ in range(2))  # a preallocated cache
    q = torch.randn(rows, 12, 64, generator=g).to(torch.bfloat16)[:, :9]  # q of a fused q/k projection: strided
    causal = torch.ones(rows, t, dtype=torch.bool).tril(t - rows)
    out = attend(q, k, v, t, None)
    torch.testing.assert_close(out.float(), _attention_reference(q, k, v, t, causal), rtol=2e-2, atol=2e-2)
    assert torch.equal(attend(q, k, v, t, causal), out)  # None means causal after the cache
    for i in range(rows):  # verify row i attends exactly as the 1-row step at its position
        assert torch.equal(attend(q[i: i + 1], k, v, t - rows + i + 1, None)[0], out[i])
    tree = causal.clone()
    tree[-1, t - rows] = False  # the last row skips the first new row: a tree branch
    torch.testing.assert_close(attend(q, k, v, t, tree).float(), _attention_reference(q, k, v, t, tree),
                               rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize(("past", "parents"), [(100, [-1, -1, 0, 0, 1, 2]), (29, [-1, 0, -1, 2, 1, 3, 3, 4])])
def test_a_tree_row_attends_exactly_as_its_plain_step_after_the_path_is_accepted(skinny, past, parents):
    """A tree node's row sees the cache and its ancestors, not its siblings; once its path is accepted, the cache
    holds exactly those keys in that order and the next plain step computes that row again: bit for bit the same
    (else bf16 speculation with trees differs from plain greedy decoding)."""
    attend, n = kernels.decode_attention(), len(parents)
    ancestors = []
    for i, p in enumerate(parents):
        ancestors.append([*(ancestors[p] if p >= 0 else []), i])
    mask = torch.zeros(n, past + n, dtype=torch.bool)
    mask[:, :past] = True
    for i, path in enumerate(ancestors):
        mask[i, [past + j for j in path]] = True
    differ = []
    for seed in range(120):  # a sum rounded another way changes a bf16 output now and then: many draws
        g = torch.Generator().manual_seed(seed)
        k, v = (torch.randn(3, past + n, 64, generator=g).to(torch.bfloat16) for _ in range(2))
        q = (4 * torch.randn(n, 9, 64, generator=g)).to(torch.bfloat16)  # peaked softmaxes: sums of unlike terms
        out = attend(q, k, v, past + n, mask)
        for i, path in enumerate(ancestors):
            keep = [*range(past), *(past + j for j in path)]  # the cache after accepting node i's path
            alone = attend(q[i: i + 1], k[:, keep].contiguous(), v[:, keep].contiguous(), len(keep), None)
            if not torch.equal(alone[0], out[i]):
                differ.append((seed, i))
    assert not differ, f"(seed, node) whose tree row differs from its plain step: {differ[:10]}"


@pytest.mark.parametrize("hd", [16, 48, 128])
def test_decode_attention_at_other_head_sizes(skinny, hd):
    """Each head size has its own compiled loop: it equals SDPA and a row equals its 1-row step there too."""
    attend, rows, t = kernels.decode_attention(), 6, 90
    g = torch.Generator().manual_seed(hd)
    k, v = (torch.randn(2, 128, hd, generator=g).to(torch.bfloat16) for _ in range(2))
    q = torch.randn(rows, 4, hd, generator=g).to(torch.bfloat16)
    out = attend(q, k, v, t, None)
    causal = torch.ones(rows, t, dtype=torch.bool).tril(t - rows)
    torch.testing.assert_close(out.float(), _attention_reference(q, k, v, t, causal), rtol=2e-2, atol=2e-2)
    for i in range(rows):
        assert torch.equal(attend(q[i: i + 1], k, v, t - rows + i + 1, None)[0], out[i])


def test_bf16_speculation_is_lossless_on_the_kernels(skinny, tiny_model_dir, spec_tiny):
    """With every row computed as it would be alone, bf16 verifies reproduce bf16 decode steps exactly."""
    from spec_support import random_prompts

    from eaglenest.engines.runtime import TargetRunner
    from eaglenest.speculative.decoder import plain_greedy
    from eaglenest.speculative.serve import load_spec_decoder
    from eaglenest.speculative.target import LeanTarget, decode_target

    runner = TargetRunner(tiny_model_dir, dtype="bfloat16")
    target = decode_target(runner.model, runner.aux_layer_ids)
    assert isinstance(target, LeanTarget) and target._kernel_attention is not None
    for shape in ("chain3", "tree3x2n5", "chain3q8", "chain3q4", "tree3x2n5q4"):
        dec = load_spec_decoder(runner, spec_tiny[2], shape=shape)
        for ids in random_prompts(4, seed=21):
            ref = plain_greedy(runner, ids, max_new_tokens=30, ignore_eos=True).output_ids
            assert dec.generate(ids, max_new_tokens=30, ignore_eos=True).output_ids == ref


def test_small_ops_match_their_torch_chains(skinny):
    """rms_norm_out, rope_ and row_argmax: what the drafter's chains of torch ops compute (argmax: exactly)."""
    from eaglenest.drafter.layers import rope_cos_sin

    g = torch.Generator().manual_seed(5)
    x, w = torch.randn(3, 1152, generator=g).to(torch.bfloat16), torch.randn(1152, generator=g)
    out = torch.zeros(3, 2304, dtype=torch.bfloat16)
    kernels.rms_norm_out()(x, w, 1e-5, out[:, 1152:], False)  # into a column block, as the drafter's input is built
    h = x.float()
    ref = (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-5) * w).to(torch.bfloat16)
    torch.testing.assert_close(out[:, 1152:], ref, rtol=8e-3, atol=1e-6)
    assert not out[:, :1152].any()
    qkv = torch.randn(2, 960, generator=g).to(torch.bfloat16)
    v = qkv[:, 768:].clone()
    cos, sin = rope_cos_sin(torch.tensor([3, 900]), 64, 10000.0)
    heads = qkv[:, :768].view(2, 12, 64)  # q and k heads of a fused projection: rows strided by 960
    hf = heads.float()
    ref = (hf * cos[:, None] + torch.cat((-hf[..., 32:], hf[..., :32]), -1) * sin[:, None]).to(torch.bfloat16)
    kernels.rope_()(heads, cos, sin, False)
    torch.testing.assert_close(heads, ref, rtol=8e-3, atol=1e-6)
    assert torch.equal(qkv[:, 768:], v)  # values untouched
    logits = torch.randn(4, 16001, generator=g).to(torch.bfloat16)
    logits[1, 7] = logits[1, 9000] = 40.0  # a tie: the first wins, as in torch
    logits[2, -1] = 50.0  # the tail past the last 16 lanes
    assert torch.equal(kernels.row_argmax(logits), logits.argmax(-1))
    assert kernels.row_argmax(logits).tolist()[1:3] == [7, 16000]
    assert torch.equal(kernels.row_argmax(logits.float()), logits.float().argmax(-1))  # fp32: torch's own


def test_bf16_drafter_and_target_on_the_kernels_compute_what_their_torch_ops_compute(skinny, tmp_path):
    """A drafter with head_dim 32 in bf16 runs its norms, RoPE, attention and argmax on the kernels: 1-row steps,
    an extend (last row only) and a tree level's masked rows give the torch path's outputs to bf16 rounding; the
    lean target's norms and RoPE on the kernels give its torch ops' logits and aux states to bf16 rounding; and
    speculation on both still reproduces plain greedy decoding."""
    from eaglenest.engines.runtime import TargetRunner
    from eaglenest.speculative.decoder import plain_greedy
    from eaglenest.speculative.draft import load_exported_drafter, write_random_draft
    from eaglenest.speculative.drafting import DraftState, FastDrafter
    from eaglenest.speculative.serve import load_spec_decoder
    from eaglenest.testing.tiny_model import build_tiny_llama

    model_dir = build_tiny_llama(tmp_path / "model", hidden=128, heads=4, kv_heads=2, intermediate=256)
    runner = TargetRunner(model_dir, dtype="bfloat16")
    folder = write_random_draft(model_dir, tmp_path / "draft", std=0.2)
    draft = load_exported_drafter(folder, embed_weight=runner.model.get_input_embeddings().weight,
                                  dtype=torch.bfloat16)
    fast, plain = FastDrafter(draft), FastDrafter(draft)
    plain._kernels = False
    assert fast._kernels
    g = torch.Generator().manual_seed(0)
    n = 12
    ids, aux = torch.randint(3, 200, (n + 3,), generator=g), torch.randn(n, 3 * 128, generator=g).to(torch.bfloat16)
    outs = {}
    with torch.inference_mode():
        for name, fd in (("kernels", fast), ("torch", plain)):
            st = DraftState(fd, 4)
            h, first = fd.forward(st, ids[:n], fd.project(aux), torch.arange(n), None, last_only=True)
            h, step = fd.forward(st, ids[n: n + 1], h, torch.tensor([n]), None)
            mask = torch.ones(2, n + 3, dtype=torch.bool)
            mask[0, n + 2] = mask[1, n + 1] = False  # two siblings of a tree level, each seeing itself
            _, tree = fd.forward(st, ids[n + 1: n + 3], h.expand(2, -1), torch.tensor([n + 1, n + 1]), mask)
            outs[name] = (first, step, tree, st.k[:, : n + 3].clone())
    for got, ref in zip(outs["kernels"], outs["torch"], strict=True):
        assert got.shape == ref.shape
        assert float((got.float() - ref.float()).norm() / ref.float().norm()) < 0.02
    from eaglenest.speculative.onednn import phase
    from eaglenest.speculative.target import LeanTarget

    lean, ref = LeanTarget(runner.model, runner.aux_layer_ids), LeanTarget(runner.model, runner.aux_layer_ids)
    ref._small_ops = False  # the target's norms and RoPE as torch ops
    assert lean._small_ops
    with torch.inference_mode(), phase(True):
        caches = [t.new_cache(32) for t in (lean, ref)]
        for rows in (ids[:n][None], ids[n: n + 1][None], ids[n + 1: n + 3][None]):  # a prefill, a step, a verify
            (got, got_aux), (want, want_aux) = (lean.forward(caches[0], rows, aux=True),
                                                ref.forward(caches[1], rows, aux=True))
            for a, b in ((got, want), (got_aux, want_aux)):
                assert float((a.float() - b.float()).norm() / b.float().norm()) < 0.02
    dec = load_spec_decoder(runner, folder, shape="chain3")
    assert dec.make_proposer().fd._kernels
    prompt = ids[:8].tolist()
    want = plain_greedy(runner, prompt, max_new_tokens=24, ignore_eos=True).output_ids
    assert dec.generate(prompt, max_new_tokens=24, ignore_eos=True).output_ids == want
