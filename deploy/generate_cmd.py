"""`pdserve generate`: one completion from a local engine, streamed or as JSON."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from deploy.engine_args import add_engine_args, engine_config


def add_generate_parser(sub: Any) -> None:
    p = sub.add_parser("generate", help="generate text with a local (colocated) engine")
    add_engine_args(p)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt")
    src.add_argument("--prompt-token-ids", default=None,
                     help="comma-separated token ids instead of a text prompt (models "
                          "without a tokenizer)")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--threads", type=int, default=0,
                   help="torch threads (default 0: the cores this process may use, cgroup "
                        "quota and affinity included)")
    p.add_argument("--json", action="store_true",
                   help="print one JSON object (token_ids, text, finish_reason, ...)")
    p.set_defaults(func=run_generate)


def run_generate(args: argparse.Namespace) -> int:
    from deploy.cpu_threads import engine_threads, passive_omp_waits

    passive_omp_waits()  # before torch's OpenMP loads
    import torch

    from engine.llm import LLM
    from engine.sampling_params import SamplingParams

    threads = engine_threads(args.threads)
    torch.set_num_threads(threads)  # before the engine exists: its ranks split this count

    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                            top_p=args.top_p, top_k=args.top_k, seed=args.seed)
    cfg = engine_config(args)
    token_ids: list[int] = []
    text = ""
    finish = None
    given = _token_ids(args.prompt_token_ids) if args.prompt_token_ids is not None else None
    with LLM(**cfg.__dict__) as llm:  # closing stops the other tensor-parallel ranks
        prompt_ids = given if given is not None else llm.encode(args.prompt, args.chat)
        for out in llm.stream([prompt_ids], params):
            token_ids += out.new_token_ids
            text += out.new_text
            finish = out.finish_reason
            if not args.json:
                sys.stdout.write(out.new_text)
                sys.stdout.flush()
    if args.json:
        print(json.dumps({"prompt_token_ids": prompt_ids, "token_ids": token_ids, "text": text,
                          "finish_reason": finish, "num_prompt_tokens": len(prompt_ids),
                          "num_output_tokens": len(token_ids), "threads": threads}))
    else:
        sys.stdout.write("\n")
    return 0


def _token_ids(text: str) -> list[int]:
    try:
        return [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise ValueError(f"prompt_token_ids (--prompt-token-ids): expected comma-separated "
                         f"integers, got {text!r}") from None
