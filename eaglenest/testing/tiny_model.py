"""Test instrument: a tiny random Llama with a real byte-level BPE tokenizer and a ChatML template.

Built in fixtures and by ``eaglenest model tiny`` (no download), so tests and demos of the pipeline run in
seconds on CPU. Never used by production paths.
"""

from __future__ import annotations

import glob
import os
from pathlib import Path

CHATML_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build_tiny_llama(
    out_dir: str | Path,
    *,
    hidden: int = 64,
    layers: int = 8,
    heads: int = 4,
    kv_heads: int = 2,
    intermediate: int = 128,
    vocab: int = 512,
    seed: int = 0,
    dtype: str = "float32",
) -> Path:
    """A tiny random Llama with a byte-level BPE tokenizer and a ChatML template (no download)."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    corpus = sorted(glob.glob(os.path.join(os.path.dirname(os.__file__), "*.py")))[:40]
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train(corpus, trainer)
    hf_tok = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|im_start|>", eos_token="<|im_end|>",
                                     pad_token="<|im_end|>", unk_token="<|endoftext|>", model_max_length=2048)
    hf_tok.chat_template = CHATML_TEMPLATE
    hf_tok.save_pretrained(str(out_dir))
    cfg = LlamaConfig(
        vocab_size=len(hf_tok), hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=2048,
        rms_norm_eps=1e-5, bos_token_id=hf_tok.bos_token_id, eos_token_id=hf_tok.eos_token_id,
        pad_token_id=hf_tok.pad_token_id, tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(cfg).to(getattr(torch, dtype))
    model.save_pretrained(str(out_dir))
    return out_dir
