"""Drafter model: equals a literal re-implementation of SGLang 0.5.17's llama_eagle3 math; vocab maps."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from eaglenest.contract import ContractError
from eaglenest.drafter.model import DrafterConfig, DraftKVCache, Eagle3Drafter
from eaglenest.drafter.target import load_target_tensors
from eaglenest.drafter.vocab import DraftVocab, build_draft_vocab


def tiny_config(**over) -> DrafterConfig:
    base = dict(hidden_size=32, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=256, vocab_size=97,
                draft_vocab_size=40, target_hidden_size=32, aux_layer_ids=(1, 3, 4))
    base.update(over)
    return DrafterConfig(**base)


def tiny_drafter(seed: int = 0, **over) -> Eagle3Drafter:
    torch.manual_seed(seed)
    cfg = tiny_config(**over)
    model = Eagle3Drafter(cfg, embed_weight=torch.randn(cfg.vocab_size, cfg.hidden_size))
    ids = torch.randperm(cfg.vocab_size)[: cfg.draft_vocab_size].sort().values
    vocab = DraftVocab(ids, cfg.vocab_size)
    model.load_vocab(vocab.d2t, vocab.t2d)
    with torch.no_grad():  # non-trivial norms so a swapped norm cannot pass
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(0.3 * torch.randn_like(p))
    return model


class SglangEagle3Reference:
    """Straight transcription of sglang/srt/models/llama_eagle3.py + llama.py (native paths), built from
    checkpoint-named tensors the way LlamaForCausalLMEagle3.load_weights stacks them."""

    def __init__(self, weights: dict[str, torch.Tensor], cfg: DrafterConfig, embed: torch.Tensor) -> None:
        w = {k.replace("midlayer", "layers.0"): v.float() for k, v in weights.items()}
        self.cfg, self.w, self.embed = cfg, w, embed.float()
        p = "layers.0."
        self.qkv = torch.cat([w[p + "self_attn.q_proj.weight"], w[p + "self_attn.k_proj.weight"],
                              w[p + "self_attn.v_proj.weight"]])
        self.gate_up = torch.cat([w[p + "mlp.gate_proj.weight"], w[p + "mlp.up_proj.weight"]])
        self.hot_token_id = weights["d2t"] + torch.arange(weights["d2t"].shape[0])
        hd = cfg.head_dim
        inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float) / hd))
        freqs = torch.einsum("i,j->ij", torch.arange(cfg.max_position_embeddings, dtype=torch.float), inv_freq)
        self.cos_sin_cache = torch.cat((freqs.cos(), freqs.sin()), dim=-1)
        self.k_cache: list[torch.Tensor] = []
        self.v_cache: list[torch.Tensor] = []

    def rmsnorm(self, name, x, residual=None):
        if residual is not None:
            x = x + residual
            residual = x
        var = x.pow(2).mean(dim=-1, keepdim=True)
        out = x * torch.rsqrt(var + self.cfg.rms_norm_eps) * self.w[name]
        return out if residual is None else (out, residual)

    def rotary(self, positions, q, k):
        cos, sin = self.cos_sin_cache.index_select(0, positions).chunk(2, dim=-1)

        def rot(x):
            n = x.shape[0]
            x = x.view(n, -1, self.cfg.head_dim)
            x1, x2 = x[..., : self.cfg.head_dim // 2], x[..., self.cfg.head_dim // 2 :]
            c, s = cos[:, None], sin[:, None]
            return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).view(n, -1)

        return rot(q), rot(k)

    def attention(self, q, k, v):
        """RadixAttention for one request: new rows see every cached row and causally each other."""
        c = self.cfg
        self.k_cache.append(k)
        self.v_cache.append(v)
        keys, vals = torch.cat(self.k_cache), torch.cat(self.v_cache)
        n, total = q.shape[0], keys.shape[0]
        q = q.view(n, c.num_attention_heads, c.head_dim)
        keys = keys.view(total, c.num_key_value_heads, c.head_dim)
        vals = vals.view(total, c.num_key_value_heads, c.head_dim)
        group = c.num_attention_heads // c.num_key_value_heads
        out = torch.empty_like(q)
        for h in range(c.num_attention_heads):
            s = q[:, h] @ keys[:, h // group].T * c.head_dim**-0.5  # [n, total]
            allowed = torch.arange(total)[None, :] <= (total - n + torch.arange(n))[:, None]
            s = s.masked_fill(~allowed, float("-inf"))
            out[:, h] = torch.softmax(s, dim=-1) @ vals[:, h // group]
        return out.reshape(n, -1)

    def forward(self, input_ids, positions, hidden_states):
        """LlamaForCausalLMEagle3.forward for one request; returns (logits, hot ids, hidden to store)."""
        c, w, p = self.cfg, self.w, "layers.0."
        embeds = self.embed[input_ids]
        if hidden_states.shape[-1] != embeds.shape[-1]:
            hidden_states = hidden_states @ w["fc.weight"].T
        # LlamaDecoderLayer (is_input_layer)
        residual = hidden_states
        hidden_states = self.rmsnorm(p + "hidden_norm.weight", hidden_states)
        embeds = self.rmsnorm(p + "input_layernorm.weight", embeds)
        hidden_states = torch.cat([embeds, hidden_states], dim=-1)
        qkv = hidden_states @ self.qkv.T
        q_size, kv_size = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        q, k = self.rotary(positions, q, k)
        hidden_states = self.attention(q, k, v) @ w[p + "self_attn.o_proj.weight"].T
        hidden_states, residual = self.rmsnorm(p + "post_attention_layernorm.weight", hidden_states, residual)
        gate_up = hidden_states @ self.gate_up.T
        d = gate_up.shape[-1] // 2
        act = torch.nn.functional.silu(gate_up[..., :d]) * gate_up[..., d:]
        hidden_states = act @ w[p + "mlp.down_proj.weight"].T
        # LlamaModel.forward tail
        to_logits, to_aux = self.rmsnorm("norm.weight", hidden_states, residual)
        logits = to_logits @ w["lm_head.weight"].T
        return logits, self.hot_token_id, to_aux


def test_forward_equals_sglang_reference_extend_then_chain():
    model = tiny_drafter().eval()
    cfg = model.config
    ref = SglangEagle3Reference(model.state_dict(), cfg, model.embed_weight)
    torch.manual_seed(1)
    n = 11
    tokens = torch.randint(0, cfg.vocab_size, (n + 1,))
    aux = torch.randn(n, cfg.num_aux * cfg.target_hidden_size)
    # draft extend for prefill: ids shifted left by one, positions 0..n-1
    ref_logits, hot, ref_hidden = ref.forward(tokens[1:], torch.arange(n), aux)
    cache = DraftKVCache()
    with torch.no_grad():
        out = model.extend(tokens[None, 1:], aux[None], torch.arange(n)[None], cache)
    torch.testing.assert_close(out.logits[0], ref_logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.hidden[0], ref_hidden, rtol=1e-5, atol=1e-5)
    # three chained draft steps: own top-1 token (through d2t), own hidden, position + 1
    ref_tok, tok = hot[ref_logits[-1].argmax()], model.to_target_ids(out.logits[0, -1].argmax())
    ref_h, h = ref_hidden[-1:], out.hidden[:, -1:]
    assert int(ref_tok) == int(tok)
    for step in range(3):
        pos = n + step
        ref_logits, _, ref_h = ref.forward(ref_tok.view(1), torch.tensor([pos]), ref_h)
        with torch.no_grad():
            out = model(tok.view(1, 1), h, torch.tensor([[pos]]), cache)
        torch.testing.assert_close(out.logits[0], ref_logits, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(out.hidden[0], ref_h, rtol=1e-5, atol=1e-5)
        ref_tok, tok, h = hot[ref_logits[-1].argmax()], model.to_target_ids(out.logits[0, -1].argmax()), out.hidden
        assert int(ref_tok) == int(tok)
    assert cache.length == n + 3
    cache.truncate(n)
    assert cache.length == n


def test_state_dict_uses_sglang_checkpoint_names():
    names = set(tiny_drafter().state_dict())
    expected = {"fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d"} | {
        f"midlayer.{n}.weight" for n in ("hidden_norm", "input_layernorm", "post_attention_layernorm",
                                         "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                                         "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")}
    assert names == expected  # the target embedding is borrowed, never saved


def test_cached_decode_equals_full_causal_forward():
    model = tiny_drafter(seed=3).eval()
    cfg = model.config
    ids = torch.randint(0, cfg.vocab_size, (2, 9))
    hidden = torch.randn(2, 9, cfg.hidden_size)
    pos = torch.arange(9).expand(2, 9)
    with torch.no_grad():
        full = model(ids, hidden, pos)
        cache = DraftKVCache()
        first = model(ids[:, :5], hidden[:, :5], pos[:, :5], cache)
        rest = [model(ids[:, j : j + 1], hidden[:, j : j + 1], pos[:, j : j + 1], cache) for j in range(5, 9)]
    got = torch.cat([first.logits] + [r.logits for r in rest], dim=1)
    torch.testing.assert_close(got, full.logits, rtol=1e-5, atol=1e-5)


def test_load_target_tensors_tied_and_untied(tiny_model_dir, tmp_path):
    from safetensors.torch import load_file, save_file

    t = load_target_tensors(tiny_model_dir)
    raw = load_file(str(tiny_model_dir / "model.safetensors"))
    assert torch.equal(t.embed, raw["model.embed_tokens.weight"])
    assert torch.equal(t.lm_head, raw["lm_head.weight"]) and not torch.equal(t.lm_head, t.embed)
    assert torch.equal(t.final_norm, raw["model.norm.weight"])
    # a tied target (SmolLM2): no lm_head.weight, the embedding is the head
    tied = tmp_path / "tied"
    tied.mkdir()
    cfg = t.config | {"tie_word_embeddings": True}
    (tied / "config.json").write_text(__import__("json").dumps(cfg))
    save_file({k: v for k, v in raw.items() if k != "lm_head.weight"}, str(tied / "model.safetensors"))
    t2 = load_target_tensors(tied)
    assert torch.equal(t2.lm_head, raw["model.embed_tokens.weight"])


def test_config_from_target_and_refusals(tiny_model_dir):
    t = load_target_tensors(tiny_model_dir)
    cfg = DrafterConfig.from_target(t.config, aux_layer_ids=(1, 3, 4), draft_vocab_size=100)
    assert (cfg.hidden_size, cfg.num_aux, cfg.vocab_size) == (64, 3, t.config["vocab_size"])
    assert DrafterConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(ContractError, match="draft_vocab_size"):
        DrafterConfig.from_target(t.config, aux_layer_ids=(1,), draft_vocab_size=10**6)
    with pytest.raises(ContractError, match="embedding"):
        Eagle3Drafter(cfg, embed_weight=torch.zeros(3, 3))


def test_draft_vocab_from_loss_masked_frequencies():
    ids = [torch.tensor([5, 5, 5, 7, 7, 1, 9]), torch.tensor([9, 9, 9, 9, 2, 2])]
    masks = [torch.tensor([1, 1, 1, 1, 1, 0, 0], dtype=torch.bool), torch.tensor([0, 0, 1, 1, 1, 1], dtype=torch.bool)]
    vocab = build_draft_vocab(zip(ids, masks, strict=True), vocab_size=12, size=4)
    # counts: 5->3, 7->2, 9->2, 2->2 (1 and the first 9s are masked out); ties by smaller id
    assert vocab.target_ids.tolist() == [2, 5, 7, 9]
    assert vocab.d2t.dtype == torch.int64 and vocab.d2t.tolist() == [2, 4, 5, 6]
    assert vocab.t2d.dtype == torch.bool and vocab.t2d.nonzero().flatten().tolist() == [2, 5, 7, 9]
    assert vocab.coverage == pytest.approx(1.0)
    small = build_draft_vocab(zip(ids, masks, strict=True), vocab_size=12, size=2)
    assert small.target_ids.tolist() == [2, 5] and small.coverage == pytest.approx(5 / 9)
    # fewer distinct tokens than slots: fill with the smallest unused ids
    big = build_draft_vocab(zip(ids, masks, strict=True), vocab_size=12, size=6)
    assert big.target_ids.tolist() == [0, 1, 2, 5, 7, 9]
    assert torch.equal(DraftVocab.from_d2t(big.d2t, 12).target_ids, big.target_ids)
    with pytest.raises(ContractError):
        DraftVocab.from_d2t(torch.tensor([3, 0]), 12)  # ids 3, 1: not ascending
    assert np.array_equal(vocab.target_ids.numpy(), np.sort(vocab.target_ids.numpy()))


def test_a_draft_vocab_widens_by_the_tokens_it_lacks_and_its_head_keeps_its_rows():
    """A continued drafter's vocabulary grows (2026-12-06d: 16,000 draft tokens held 94.5% of ShareGPT's answer
    tokens, 32,000 of the same answers' most frequent 98.6%): every id it has stays, the most frequent ids it lacks
    join (ties: smaller id; unseen ids, smallest first, when the counts run out); its LM head keeps its rows and each
    added token starts from a zero row."""
    from eaglenest.drafter.vocab import widen_head

    counts = np.zeros(12, dtype=np.int64)
    counts[[2, 5, 7, 9, 3, 11, 4]] = [1, 9, 8, 1, 6, 6, 2]
    own = DraftVocab(torch.tensor([2, 5, 9]), 12)  # 2 and 9 stay although rarer than 3, 11 and 4
    wider = own.widened(counts, 6)
    assert wider.target_ids.tolist() == [2, 3, 5, 7, 9, 11] and wider.coverage == pytest.approx(31 / 33)
    assert own.widened(counts, 9).target_ids.tolist() == [0, 1, 2, 3, 4, 5, 7, 9, 11]
    for bad in (3, 13):
        with pytest.raises(ContractError, match=r"a wider draft vocabulary needs a size in 4\.\.12"):
            own.widened(counts, bad)
    head = torch.arange(3 * 4, dtype=torch.bfloat16).reshape(3, 4) + 1
    out = widen_head(head, own, wider)
    assert out.shape == (6, 4) and out.dtype == head.dtype
    assert torch.equal(out[[0, 2, 4]], head)  # ids 2, 5, 9 at their new places
    assert not out[[1, 3, 5]].any()  # the added ids 3, 7, 11: zero rows (logit 0: not drafted until trained)
    with pytest.raises(ContractError, match="does not widen"):
        widen_head(head[:2], own, wider)
    with pytest.raises(ContractError, match="does not widen"):
        widen_head(head, own, DraftVocab(torch.tensor([2, 3, 5, 7, 10, 11]), 12))  # 9 is gone
