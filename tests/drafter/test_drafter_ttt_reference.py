"""A second, deliberately naive EAGLE-3 TTT loss written from the algorithm (EAGLE-3 paper; SpecForge's
eagle3 training with its cached-hidden attention), with explicit loops over samples, TTT steps and positions
and its own norm / RoPE / attention / MLP math read straight from the weights. It shares nothing with
eaglenest/drafter/ttt.py or the model's helper methods; the production objective must agree with it.

The algorithm, per sample (tokens x, target aux states a, target final states f, loss mask m):
- step 0 at anchor t: hidden h = fc(a[t]); the input token is x[t+1] (the shift: the draft row at t reads
  the NEXT token's embedding); position t; attention over the step-0 keys of anchors 0..t;
- step i >= 1 at anchor t: hidden = the step i-1 output at t (pre-norm), token x[t+1+i] (teacher forced),
  position t+i; attention over the step-0 keys of 0..t plus the keys of steps 1..i at this same anchor;
- the layer: u = [rms(embed) * w_in ; rms(hidden) * w_hidden]; q, k, v = W u, RoPE on q and k;
  r = o(attn) + hidden; out = mlp(rms(r) * w_post) + r; logits = lm_head(rms(out) * w_norm) (draft vocab);
- target of (t, i): the row j = t+1+i (counted iff m[j]): p = softmax over the draft vocabulary of the
  target's LM head at f[j]; loss KL(p || q) summed over counted rows whose full-vocabulary target argmax is in
  the draft vocabulary, divided by the number of counted rows of step i, weighted 0.8^i;
- accuracy of step i: the draft argmax (mapped to target ids by d2t) equals the full-vocabulary target argmax.
"""

from __future__ import annotations

import math

import pytest
import torch

from eaglenest.drafter.data import collate
from eaglenest.drafter.model import DrafterConfig, Eagle3Drafter
from eaglenest.drafter.target import load_target_tensors
from eaglenest.drafter.ttt import step_counts, target_rows, ttt_forward
from eaglenest.drafter.vocab import build_draft_vocab
from eaglenest.store.encoding import StoreSample


def rms(x, w, eps):
    return x / torch.sqrt((x * x).mean() + eps) * w


def rope(v, pos, theta):
    d = v.shape[0]
    half = d // 2
    out = torch.empty_like(v)
    for f in range(half):
        angle = pos * theta ** (-2.0 * f / d)
        c, s = math.cos(angle), math.sin(angle)
        out[f] = v[f] * c - v[f + half] * s
        out[f + half] = v[f + half] * c + v[f] * s
    return out


def naive_ttt(model: Eagle3Drafter, sample, head: torch.Tensor, k: int, decay: float = 0.8):
    """(loss terms per step [sum of KL], counted rows per step, correct per step) for one sample."""
    cfg = model.config
    sd = {n: p.detach().double() for n, p in model.state_dict().items() if p.is_floating_point()}
    emb, eps, theta = model.embed_weight.double(), cfg.rms_norm_eps, cfg.rope_theta
    nh, nkv, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    d2t = model.d2t
    draft_to_target = [i + int(d2t[i]) for i in range(cfg.draft_vocab_size)]
    x = sample.input_ids.long().tolist()
    m = sample.loss_mask.bool().tolist()
    a, f = sample.aux_hidden.double(), sample.final_hidden.double()
    head = head.double()
    n = len(x)
    w = lambda name: sd[name]  # noqa: E731

    def layer(tok, hidden, pos):
        e = emb[tok]
        u = torch.cat([rms(e, w("midlayer.input_layernorm.weight"), eps),
                       rms(hidden, w("midlayer.hidden_norm.weight"), eps)])
        q = (w("midlayer.self_attn.q_proj.weight") @ u).view(nh, hd)
        kk = (w("midlayer.self_attn.k_proj.weight") @ u).view(nkv, hd)
        vv = (w("midlayer.self_attn.v_proj.weight") @ u).view(nkv, hd)
        q = torch.stack([rope(q[h], pos, theta) for h in range(nh)])
        kk = torch.stack([rope(kk[h], pos, theta) for h in range(nkv)])
        return q, kk, vv

    def finish(q, keys, values, hidden):
        heads = []
        for h in range(nh):
            g = h // (nh // nkv)
            scores = torch.stack([q[h] @ key[g] for key in keys]) / math.sqrt(hd)
            p = torch.softmax(scores, dim=0)
            heads.append(sum(p[s] * values[s][g] for s in range(len(keys))))
        r = w("midlayer.self_attn.o_proj.weight") @ torch.cat(heads) + hidden
        y = rms(r, w("midlayer.post_attention_layernorm.weight"), eps)
        gate, up = w("midlayer.mlp.gate_proj.weight") @ y, w("midlayer.mlp.up_proj.weight") @ y
        return w("midlayer.mlp.down_proj.weight") @ (gate * torch.sigmoid(gate) * up) + r

    # step 0 keys/values at every anchor (the draft KV cache built from target features)
    k0, v0, q0, h0 = [], [], [], []
    for t in range(n):
        hidden = w("fc.weight") @ a[t]
        tok = x[t + 1] if t + 1 < n else 0
        q, kk, vv = layer(tok, hidden, t)
        k0.append(kk)
        v0.append(vv)
        q0.append(q)
        h0.append(hidden)
    loss, counted, correct = [0.0] * k, [0] * k, [0] * k
    for t in range(n):
        hidden, own_k, own_v = h0[t], [], []
        for i in range(k):
            if i == 0:
                out = finish(q0[t], k0[: t + 1], v0[: t + 1], hidden)
            else:
                tok = x[t + 1 + i] if t + 1 + i < n else 0
                q, kk, vv = layer(tok, hidden, t + i)
                own_k.append(kk)
                own_v.append(vv)
                out = finish(q, k0[: t + 1] + own_k, v0[: t + 1] + own_v, hidden)
            hidden = out
            j = t + 1 + i
            if j >= n or not m[j]:
                continue
            logits = w("lm_head.weight") @ rms(out, w("norm.weight"), eps)
            logq = torch.log_softmax(logits, dim=0)
            full = head @ f[j]
            target = int(full.argmax())
            logp = torch.log_softmax(torch.stack([full[draft_to_target[d]] for d in range(len(draft_to_target))]), 0)
            counted[i] += 1
            if target in draft_to_target:
                loss[i] += float((logp.exp() * (logp - logq)).sum())
            correct[i] += int(draft_to_target[int(logits.argmax())] == target)
    return loss, counted, correct


def test_production_ttt_loss_equals_the_naive_algorithm(tiny_model_dir, drafter_store):
    torch.manual_seed(0)
    tt = load_target_tensors(tiny_model_dir)
    def tail(s, n):  # the last n tokens (answer + the end of the prompt) keep the naive loops short
        return _with(s, input_ids=s.input_ids[-n:], loss_mask=s.loss_mask[-n:],
                                   aux_hidden=s.aux_hidden[-n:], final_hidden=s.final_hidden[-n:])

    samples = [tail(drafter_store[0], 26), tail(drafter_store[5], 18)]
    # a vocabulary from OTHER samples: some target argmaxes fall outside it (the in-vocabulary rule is exercised)
    others = [drafter_store[i] for i in (1, 2, 3)]
    vocab = build_draft_vocab(((s.input_ids, s.loss_mask) for s in others), vocab_size=int(tt.config["vocab_size"]),
                              size=40)
    cfg = DrafterConfig.from_target(tt.config, aux_layer_ids=drafter_store.provenance.aux_layer_ids,
                                    draft_vocab_size=vocab.size)
    model = Eagle3Drafter(cfg, embed_weight=tt.embed.float())
    model.load_vocab(vocab.d2t, vocab.t2d)
    k, decay = 3, 0.8
    head = tt.lm_head.float()
    batch = collate(samples, [0, 5], max_seq_len=2048, dtype=torch.float32)  # right padding in one row
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    for _ in range(15):  # a few steps, so the draft agrees with the target at some rows but not all
        rows = target_rows(batch, head, vocab.target_ids, model.t2d)
        sum(r.loss_sum for r in ttt_forward(model, batch, rows, k)).backward()
        opt.step()
        opt.zero_grad()
    with torch.no_grad():
        rows = target_rows(batch, head, vocab.target_ids, model.t2d)
        results = ttt_forward(model, batch, rows, k)
    counts = step_counts(batch.loss_mask, k)
    naive = [naive_ttt(model, s, head, k) for s in samples]
    for i in range(k):
        n_loss = sum(x[0][i] for x in naive)
        n_counted = sum(x[1][i] for x in naive)
        n_correct = sum(x[2][i] for x in naive)
        assert results[i].counted == n_counted == int(counts[i])
        assert int(results[i].correct) == n_correct, (i, results[i].correct, n_correct)
        torch.testing.assert_close(float(results[i].loss_sum), n_loss, rtol=1e-4, atol=1e-5)
    total = sum(decay**i * float(results[i].loss_sum) / float(counts[i]) for i in range(k))
    naive_total = sum(decay**i * sum(x[0][i] for x in naive) / sum(x[1][i] for x in naive) for i in range(k))
    assert total == pytest.approx(naive_total, rel=1e-4)
    assert 0 < sum(x[2][0] for x in naive) < sum(x[1][0] for x in naive)  # neither trivial 0% nor 100%
    assert not bool(rows.in_vocab.all())  # some rows are out of the draft vocabulary


def _with(s: StoreSample, **changes) -> StoreSample:
    """A copy of a store sample with some of its fields replaced."""
    fields = {k: getattr(s, k) for k in ("sample_id", "input_ids", "loss_mask", "aux_hidden", "final_hidden")}
    return StoreSample(**{**fields, **changes})
