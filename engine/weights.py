"""Read checkpoints: GGUF files and Hugging Face folders (which names exist: `engine.model_info`).

`load_checkpoint(name_or_path, dtype)` returns a `Checkpoint`: the `ModelConfig`,
the `Tokenizer` and the weights as `{hf_name: tensor}` in Hugging Face naming
(`model.layers.0.self_attn.q_proj.weight`, ...), whatever the file format. GGUF
tensors are dequantized to `dtype`; llama.cpp's RoPE permutation of `attn_q` and
`attn_k` is undone so the weights are the Hugging Face ones.

`smollm2-135m-moe` is built from the dense checkpoint by `engine.upcycle`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from engine.config import ConfigError, ModelConfig
from engine.gguf_dequant import dequantize
from engine.model_info import UPCYCLED, WeightsError, gguf_header, hf_config, resolve_model
from engine.tokenizer import Tokenizer
from engine.upcycle import upcycle


@dataclass(frozen=True, slots=True)
class Checkpoint:
    config: ModelConfig
    tokenizer: Tokenizer
    weights: dict[str, torch.Tensor]
    source: Path


def load_checkpoint(name_or_path: str, dtype: torch.dtype = torch.float32) -> Checkpoint:
    if name_or_path in UPCYCLED:
        dense = load_checkpoint(UPCYCLED[name_or_path][0], dtype)
        config, weights = upcycle(name_or_path, dense.config, dense.weights)
        return Checkpoint(config, dense.tokenizer, weights, Path(name_or_path))
    path = resolve_model(name_or_path)
    if path.is_file():
        return _load_gguf(path, dtype)
    return _load_hf_folder(path, dtype)


# ---- Hugging Face folders ----------------------------------------------------------------


def _load_hf_folder(folder: Path, dtype: torch.dtype) -> Checkpoint:
    from safetensors import SafetensorError, safe_open

    config = hf_config(folder)
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


def _load_gguf(path: Path, dtype: torch.dtype) -> Checkpoint:
    tensors, config, tokenizer = gguf_header(path)
    weights: dict[str, torch.Tensor] = {}
    for tensor in tqdm(tensors, desc="Dequantizing GGUF", unit="tensor", delay=1.0):
        try:
            array = dequantize(tensor)
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


__all__ = ["Checkpoint", "ConfigError", "WeightsError", "load_checkpoint"]  # a load raises either error
