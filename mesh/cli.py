"""The `infermesh` command line.

    infermesh generate "What is the capital of France?" --chat
    infermesh generate "Once upon a time" --max-tokens 64 --temperature 0.8 --seed 1 --json

`generate` runs the engine in this process and streams text to stdout as it is
produced; `--json` then prints one JSON object on the last line. Bad arguments
exit with code 2 and a one-line message on stderr.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Optional

import typer

app = typer.Typer(no_args_is_help=True, add_completion=False, help="infermesh: serve LLMs as a mesh of disaggregated roles.")


@app.callback()
def main() -> None:
    """infermesh admin CLI."""


def _fail(message: str) -> None:
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(code=2)


@app.command()
def generate(
    prompt: str = typer.Argument(..., help="The prompt (a user message with --chat)."),
    model: str = typer.Option("smollm2-135m", help="Bundled model name or path to a GGUF file / HF folder."),
    chat: bool = typer.Option(False, "--chat", help="Apply the model's chat template to PROMPT as a user message."),
    max_tokens: int = typer.Option(256, help="Most tokens to generate."),
    temperature: float = typer.Option(0.0, help="0 is greedy."),
    top_p: float = typer.Option(1.0, help="Nucleus sampling mass, in (0, 1]."),
    top_k: int = typer.Option(0, help="Keep the k most likely tokens; 0 disables."),
    seed: Optional[int] = typer.Option(None, help="Seed for sampling."),
    ignore_eos: bool = typer.Option(False, "--ignore-eos", help="Keep generating past end-of-sequence."),
    dtype: str = typer.Option("bfloat16", help="float32 | bfloat16 | float16."),
    tp: int = typer.Option(1, "--tp", help="Tensor-parallel ranks (local processes)."),
    cp: int = typer.Option(1, "--cp", help="Context-parallel ranks (local processes)."),
    ep: int = typer.Option(1, "--ep", help="Expert-parallel ranks (MoE models; 1 or equal to --tp)."),
    cp_method: str = typer.Option("auto", help="auto | pass_kv | pass_q: how CP prefill attends."),
    as_json: bool = typer.Option(False, "--json", help="Print a JSON object with ids, usage and timings last."),
) -> None:
    """Generate text for PROMPT, streaming it as it is produced."""
    from engine import LLM, SamplingParams
    from engine.parallel.launcher import ParallelError

    if not prompt:
        _fail("prompt must not be empty")
    try:
        params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                                seed=seed, ignore_eos=ignore_eos)
        llm = LLM(model, dtype=dtype, tp=tp, cp=cp, ep=ep, cp_method=cp_method)
    except ValueError as e:  # every engine input error (params, request, weights, config, layout) is a ValueError
        _fail(str(e))
    try:
        ids = llm.tokenizer.encode_chat([{"role": "user", "content": prompt}]) if chat else llm.tokenizer.encode(prompt)
        start = time.monotonic()
        first = None
        token_ids: list[int] = []
        text, reason = "", None
        for delta in llm.stream(ids, params):
            first = first or time.monotonic()
            token_ids += delta.token_ids
            text += delta.text
            reason = delta.finish_reason
            sys.stdout.write(delta.text)
            sys.stdout.flush()
        end = time.monotonic()
    except ValueError as e:
        _fail(str(e))
    except ParallelError as e:  # a rank of a parallel engine failed: its first line, exit 1
        typer.echo(f"error: {str(e).splitlines()[0]}", err=True)
        raise typer.Exit(code=1)
    finally:
        llm.close()
    sys.stdout.write("\n")
    if as_json:
        ttft = (first or end) - start
        decode_s = end - (first or end)
        result = {
            "text": text,
            "token_ids": token_ids,
            "prompt_token_ids": ids,
            "finish_reason": reason,
            "usage": {"prompt_tokens": len(ids), "completion_tokens": len(token_ids)},
            "timings": {"ttft_s": round(ttft, 4),
                        "tokens_per_s": round((len(token_ids) - 1) / decode_s, 2) if decode_s > 0 else 0.0},
        }
        sys.stdout.write(json.dumps(result) + "\n")


if __name__ == "__main__":
    app()
