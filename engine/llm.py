"""Python API over one engine: build it from a config, generate or stream completions."""

from __future__ import annotations

import dataclasses
import itertools
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from engine.attention import kernels_for
from engine.compile_watch import process_watch
from engine.config import EngineConfig
from engine.kv_scales import kv_scales_for
from engine.llm_engine import LLMEngine
from engine.model_identity import model_identity
from engine.model_source import model_display_name, resolve_model
from engine.outputs import RequestOutput
from engine.request import TokenLogprob
from engine.sampling_params import SamplingParams
from engine.sim_runner import sim_model_config
from engine.warmup import wants_warmup, warm_up
from engine.weights import build_model, read_model_config

if TYPE_CHECKING:
    from engine.tokenizer import Tokenizer


def _model_path(config: EngineConfig) -> str:
    weightless = config.load_format == "dummy" or config.simulate is not None
    if weightless and config.model and os.path.isdir(config.model) \
            and os.path.isfile(os.path.join(config.model, "config.json")):
        return os.path.abspath(config.model)  # dummy weights (or none) need only the config
    return resolve_model(config.model)


def build_engine(config: EngineConfig) -> LLMEngine:
    """One engine; with tensor_parallel_size N, this process is rank 0 and N - 1 follower
    processes are spawned (and stopped by LLMEngine's runner.close(), or when it dies)."""
    path = _model_path(config)
    if config.simulate is not None:
        return _build_sim_engine(config, path)
    model_cfg = read_model_config(path)
    tp = config.tensor_parallel_size
    followers = None
    if tp > 1 or config.devices is not None:
        from engine.parallel.devices import rank_devices
        from engine.parallel.shards import check_tp
        from engine.quant.checkpoint import check_tp_cut

        check_tp(model_cfg, tp)  # before any process starts
        check_tp_cut(model_cfg, tp)
        devices = rank_devices(config)
        if devices[0] != config.device:
            config = dataclasses.replace(config, device=devices[0])
    if config.data_parallel_size > 1:
        from engine.parallel.dp_groups import check_dp

        check_dp(tp, config.data_parallel_size, model_cfg.moe is not None)
    device = torch.device(config.device)
    if device.type == "cuda" and device.index is not None:
        # Triton launches on the thread's current device, not the tensors': an engine on
        # cuda:1 built and stepped by a thread still on cuda:0 fails its first kernel
        torch.cuda.set_device(device)
    group = None
    if tp > 1:
        from engine.parallel.followers import TPFollowers

        followers = TPFollowers(config, path, devices)
        group = followers.group
        if config.data_parallel_size > 1:
            from engine.parallel.dp_groups import make_attention_group

            group = make_attention_group(followers.group, followers.group_store, tp,
                                         config.data_parallel_size)
    try:
        kernels = kernels_for(device,
                              force_reference=bool(config.extra.get("reference_kernels")))
        max_len = config.max_model_len or min(model_cfg.max_position_embeddings, 8192)
        model = build_model(path, model_cfg, kernels, device, config.dtype,
                            config.load_format, max_positions=max(max_len, 1),
                            seed=config.seed, group=group, quantization=config.quantization)
        tokenizer = _tokenizer(path)
        # the KV fingerprint names the weights, not the directory (engine/model_identity.py)
        identity = model_identity(path, config.load_format, config.seed,
                                  config.quantization)
        engine = LLMEngine(config, model_cfg, model, tokenizer, model_display_name(path),
                           identity, kv_scales=kv_scales_for(config, model_cfg, path),
                           followers=followers)
        # after the KV pool and decode graphs exist, before anything serves (the simulated
        # engine, returned above, has no kernels to compile)
        # every Triton compile from here on is logged (engine/compile_watch.py): one a
        # request meets while serving stalls its whole step for a second or two
        watch = process_watch() if torch.device(config.device).type == "cuda" else None
        if watch is not None:
            watch.serving = False
        if wants_warmup(config):
            warm_up(engine)
        if watch is not None:
            watch.serving = True
        return engine
    except BaseException:
        if followers is not None:
            followers.close(grace_s=0.0)
        raise


def _tokenizer(path: str) -> Tokenizer | None:
    if path.endswith(".gguf") or os.path.isfile(os.path.join(path, "tokenizer.json")):
        from engine.tokenizer import Tokenizer

        return Tokenizer.from_source(path)
    return None


def _build_sim_engine(config: EngineConfig, path: str) -> LLMEngine:
    """A simulated engine (engine/sim_runner.py) serving the model at ``path``: its config
    and tokenizer, no weights, and a KV pool of the smallest shape in host memory whatever
    --device says."""
    if config.tensor_parallel_size != 1 or config.devices is not None:
        raise ValueError("simulate_step_ms: a simulated engine has one rank "
                         "(no --tensor-parallel-size or --devices)")
    config = dataclasses.replace(config, device="cpu", gpu_memory_utilization=None)
    model_cfg = sim_model_config(read_model_config(path))
    # never a real model's fingerprint: no real engine may take a simulated engine's "KV"
    identity = "sim:" + model_identity(path, "dummy", config.seed)
    return LLMEngine(config, model_cfg, None, _tokenizer(path), model_display_name(path),
                     identity)


@dataclass
class Completion:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)


Prompt = str | list[int]


class LLM:
    """`LLM(model=None).generate(["Hi"], SamplingParams(max_tokens=8))` -> list[Completion]."""

    def __init__(self, model: str | None = None, **engine_args: Any) -> None:
        self.engine = build_engine(EngineConfig(model=model, **engine_args))
        self.tokenizer = self.engine.tokenizer
        self._ids = itertools.count()

    def close(self) -> None:
        """Stops the engine's other tensor-parallel ranks (no-op for one rank)."""
        self.engine.runner.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def encode(self, prompt: Prompt, chat: bool = False) -> list[int]:
        if isinstance(prompt, list):
            return prompt
        if self.tokenizer is None:
            raise ValueError("prompt: this model has no tokenizer; pass token ids")
        if chat:
            return self.tokenizer.encode_chat([{"role": "user", "content": prompt}])
        return self.tokenizer.encode(prompt)

    def stream(self, prompts: Sequence[Prompt], params: SamplingParams | Sequence[SamplingParams],
               chat: bool = False, dp_ranks: Sequence[int | None] | None = None
               ) -> Iterator[RequestOutput]:
        """Yields every engine output as it is produced, for all prompts together.
        dp_ranks: the attention data-parallel group of each prompt (None: least loaded)."""
        plist = list(params) if isinstance(params, Sequence) else [params] * len(prompts)
        if len(plist) != len(prompts):
            raise ValueError("params: need one SamplingParams per prompt")
        ranks = list(dp_ranks) if dp_ranks is not None else [None] * len(prompts)
        if len(ranks) != len(prompts):
            raise ValueError("dp_ranks: need one per prompt")
        ids = [f"req-{next(self._ids)}" for _ in prompts]
        added = []
        try:
            for rid, prompt, p, g in zip(ids, prompts, plist, ranks, strict=True):
                self.engine.add_request(rid, self.encode(prompt, chat), p, dp_rank=g)
                added.append(rid)
            while self.engine.has_unfinished():
                yield from self.engine.step().outputs
        finally:
            for rid in added:
                self.engine.abort(rid)

    def generate(self, prompts: Sequence[Prompt],
                 params: SamplingParams | Sequence[SamplingParams] | None = None,
                 chat: bool = False, dp_ranks: Sequence[int | None] | None = None
                 ) -> list[Completion]:
        """Runs every prompt to completion; results in prompt order."""
        params = params if params is not None else SamplingParams()
        done: dict[str, Completion] = {}
        for out in self.stream(prompts, params, chat, dp_ranks):
            c = done.setdefault(out.request_id, Completion(out.request_id, []))
            c.token_ids += out.new_token_ids
            c.text += out.new_text
            c.logprobs += out.new_logprobs
            c.finish_reason = out.finish_reason
        result = sorted(done.values(), key=lambda c: int(c.request_id.split("-")[1]))
        for c, prompt in zip(result, prompts, strict=True):
            c.prompt_token_ids = self.encode(prompt, chat)
        return result
