"""Tokenizer and chat template. Imports neither torch nor numpy: the router uses it alone.

`Tokenizer` wraps a `tokenizers.Tokenizer` built either from a Hugging Face
`tokenizer.json` or from the vocab and merges stored in GGUF metadata (a byte-level
BPE, the way `transformers` builds it from the same file), plus the model's chat
template rendered with jinja2 in a sandbox. `IncrementalDetokenizer` turns a stream
of token ids into text deltas that never split a UTF-8 character.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any, Sequence

from tokenizers import AddedToken, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

_GGUF_CONTROL, _GGUF_USER_DEFINED = 3, 4


class TokenizerError(ValueError):
    pass


class Tokenizer:
    def __init__(
        self,
        backend: HFTokenizer,
        *,
        chat_template: str | None,
        bos_token_id: int | None,
        eos_token_ids: Sequence[int],
        add_bos_token: bool = False,
    ) -> None:
        self._backend = backend
        self.chat_template = chat_template
        self.bos_token_id = bos_token_id
        self.eos_token_ids = tuple(eos_token_ids)
        self.add_bos_token = add_bos_token
        self._template = None

    # ---- constructors -------------------------------------------------------------

    @classmethod
    def from_gguf_metadata(cls, meta: dict[str, Any]) -> "Tokenizer":
        kind = meta.get("tokenizer.ggml.model")
        if kind != "gpt2":
            raise TokenizerError(f"GGUF tokenizer model {kind!r} is not supported; supported: gpt2 (byte-level BPE)")
        tokens: list[str] = meta["tokenizer.ggml.tokens"]
        merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
        backend = HFTokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, fuse_unk=False))
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        backend.decoder = decoders.ByteLevel()
        types = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
        specials = [tokens[i] for i, t in enumerate(types) if t in (_GGUF_CONTROL, _GGUF_USER_DEFINED)]
        backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
        bos = meta.get("tokenizer.ggml.bos_token_id")
        eos = meta.get("tokenizer.ggml.eos_token_id")
        return cls(
            backend,
            chat_template=meta.get("tokenizer.chat_template"),
            bos_token_id=bos,
            eos_token_ids=[eos] if eos is not None else [],
            add_bos_token=bool(meta.get("tokenizer.ggml.add_bos_token", False)),
        )

    @classmethod
    def from_hf_folder(cls, folder: str | Path) -> "Tokenizer":
        folder = Path(folder)
        path = folder / "tokenizer.json"
        if not path.is_file():
            raise TokenizerError(f"{folder} has no tokenizer.json")
        backend = HFTokenizer.from_file(str(path))
        cfg: dict[str, Any] = {}
        if (folder / "tokenizer_config.json").is_file():
            cfg = json.loads((folder / "tokenizer_config.json").read_text())
        template = cfg.get("chat_template")
        if (folder / "chat_template.jinja").is_file():
            template = (folder / "chat_template.jinja").read_text()
        model_cfg = json.loads((folder / "config.json").read_text()) if (folder / "config.json").is_file() else {}

        def token_id(value: Any) -> int | None:
            if isinstance(value, dict):
                value = value.get("content")
            return backend.token_to_id(value) if isinstance(value, str) else None

        eos = model_cfg.get("eos_token_id")
        eos_ids = eos if isinstance(eos, list) else [eos] if eos is not None else []
        cfg_eos = token_id(cfg.get("eos_token"))
        if cfg_eos is not None and cfg_eos not in eos_ids:
            eos_ids.append(cfg_eos)
        bos = token_id(cfg.get("bos_token"))
        bos = bos if bos is not None else model_cfg.get("bos_token_id")
        return cls(backend, chat_template=template, bos_token_id=bos,
                   eos_token_ids=eos_ids)

    # ---- use ----------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        return self._backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        ids = self._backend.encode(text, add_special_tokens=add_special_tokens).ids
        bos = self.bos_token_id
        if add_special_tokens and self.add_bos_token and bos is not None and ids[:1] != [bos]:
            ids = [self.bos_token_id, *ids]
        return ids

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str | None:
        return self._backend.id_to_token(token_id)

    def apply_chat_template(self, messages: Sequence[dict[str, str]], *, add_generation_prompt: bool = True) -> str:
        if not messages:
            raise TokenizerError("messages must not be empty")
        for i, message in enumerate(messages):
            if not isinstance(message, dict) or "role" not in message or "content" not in message:
                raise TokenizerError(f"messages[{i}] must be a dict with 'role' and 'content'")
        if self.chat_template is None:
            raise TokenizerError("this model has no chat template; use generate() with a plain prompt")
        if self._template is None:
            self._template = _compile_template(self.chat_template)
        special = lambda i: self._backend.id_to_token(i) if i is not None else ""  # noqa: E731
        return self._template.render(
            messages=list(messages),
            add_generation_prompt=add_generation_prompt,
            bos_token=special(self.bos_token_id),
            eos_token=special(self.eos_token_ids[0] if self.eos_token_ids else None),
        )

    def encode_chat(self, messages: Sequence[dict[str, str]]) -> list[int]:
        # The template writes the special tokens itself (BOS included when it wants one).
        return self.encode(self.apply_chat_template(messages), add_special_tokens=False)


def _compile_template(source: str):
    from jinja2.exceptions import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str):
        raise TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    env.filters["tojson"] = lambda x, indent=None: json.dumps(x, ensure_ascii=False, indent=indent)
    return env.from_string(source)


class IncrementalDetokenizer:
    """Text deltas for a growing list of token ids; holds back bytes of an unfinished character."""

    def __init__(self, tokenizer: Tokenizer, *, skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = []
        self._prefix_offset = 0  # start of the window decoded for context
        self._read_offset = 0  # ids before this are already emitted

    def push(self, token_id: int) -> str:
        self._ids.append(token_id)
        window = self._ids[self._prefix_offset:]
        emitted = self._tokenizer.decode(self._ids[self._prefix_offset:self._read_offset],
                                         skip_special_tokens=self._skip)
        text = self._tokenizer.decode(window, skip_special_tokens=self._skip)
        if len(text) <= len(emitted) or text.endswith("\ufffd"):
            return ""
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        return text[len(emitted):]
