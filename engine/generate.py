"""Try a model from the command line, streaming the answer token by token.

python -m engine.generate --model demo "Can I pause my annual subscription?"
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
import uuid

from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from engine.request import Request, SamplingParams


def build_prompt(tokenizer, text: str, raw: bool) -> list[int]:
    if raw or not getattr(tokenizer, "chat_template", None):
        return tokenizer.encode(text)
    messages = [{"role": "user", "content": text}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)  # BatchEncoding in v5


async def run(args: argparse.Namespace) -> None:
    config = EngineConfig(model=args.model, dtype=args.dtype, device=args.device)
    from demo.paths import resolve_model  # the CLI knows the demo names; the engine does not

    engine = AsyncEngine.from_config(config, resolve_model=resolve_model)
    await engine.start()
    try:
        params = SamplingParams(
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            top_p=args.top_p,
            seed=args.seed,
        )
        for text in args.prompt:
            ids = build_prompt(engine.tokenizer, text, args.raw)
            request = Request(request_id=uuid.uuid4().hex, prompt_token_ids=ids, sampling=params)
            start = time.perf_counter()
            first = None
            async for delta in engine.generate(request):
                if first is None and delta.token_ids:
                    first = time.perf_counter() - start
                sys.stdout.write(delta.text)
                sys.stdout.flush()
                if delta.finished:
                    total = time.perf_counter() - start
                    n = delta.num_output_tokens
                    print(
                        f"\n[{delta.finish_reason}; {n} tokens; TTFT {1000 * (first or 0):.1f} ms;"
                        f" {n / total:.0f} tok/s]",
                        file=sys.stderr,
                    )
    finally:
        await engine.shutdown()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("prompt", nargs="+", help="one or more user messages")
    p.add_argument("--model", default="demo", help='"demo" or a local HF model directory')
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--device", default="cpu")
    p.add_argument("--raw", action="store_true", help="no chat template: complete the text")
    asyncio.run(run(p.parse_args(argv)))


if __name__ == "__main__":
    main()
