"""A model runner with no model: steps take a configured time, tokens come from a hash.

The simulated engine (engine/sim_config.py) keeps everything around the forward real: the
scheduler batches by --max-num-seqs and the token budget, blocks are allocated, pushed and
freed, outputs are detokenized with the served model's tokenizer and streamed. Only
``execute`` differs from ModelRunner's:

* time: the step occupies a simulated device for ``SimConfig.step_s`` from when the device
  is free (launched at once, like a GPU launch). Reading its ids is the host sync, so it
  waits until the step is done, and deferred output overlaps the host's work with the next
  step exactly as on a GPU.
* host: with ``prefill_launch_ms`` a step with prompt tokens first spends that long on the
  host in small torch calls (each drops the GIL for microseconds, as a CUDA launch's
  does), in ``SIM_LAYERS`` slices with the engine's between-layer hook called after each,
  as a GPU host's eager prefill launch of a decoder stack; the device's time runs beside
  it, and the step ends when both are done.
* tokens: the token at position p of a request with seed s is ``token_for(s, p)``, a pure
  function, so a P/D pair (token 0 on the producer, the rest on the consumer) and a
  colocated engine give the same tokens, in any batch. It is never EOS or a special token
  unless ``eos_prob`` asks for EOS; sampling parameters (temperature, top-k, penalties) are
  ignored; stop ids, stop strings, min/max_tokens work as always (the engine checks them).

The KV pool has a tiny shape (one layer, one head) whatever the model, so a simulated
cluster fits anywhere; its contents are never written.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from engine.config import EngineConfig, ModelConfig
from engine.inflight_step import InflightStep
from engine.model_runner import ModelRunner
from engine.request import Request
from engine.sampler import SamplerOutput
from engine.scheduler import ScheduledChunk
from engine.sim_config import SimConfig

if TYPE_CHECKING:
    from engine.models.llama import LlamaForCausalLM
    from engine.parallel.followers import TPFollowers
    from engine.tokenizer import Tokenizer

_M64 = (1 << 64) - 1
_EOS_SALT = 0x5EED_E05


# the decoder layers a simulated eager launch is cut into (its between_layers calls)
SIM_LAYERS = 32


def _mix(x: int) -> int:
    """splitmix64's finalizer: a 64-bit avalanche of a 64-bit value."""
    x = (x + 0x9E3779B97F4A7C15) & _M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


def _key(seed: int, position: int) -> int:
    return _mix(_mix(seed & _M64) ^ position)


def sim_model_config(cfg: ModelConfig) -> ModelConfig:
    """The served model's vocabulary, EOS and length, with the smallest KV shape."""
    return dataclasses.replace(cfg, num_layers=1, num_kv_heads=1, num_heads=1, head_dim=8,
                               hidden_size=8, intermediate_size=8)


def plain_token_ids(vocab_size: int, eos: frozenset[int],
                    tokenizer: Tokenizer | None) -> list[int]:
    """Ids a simulated step may sample: not EOS, and with text of their own (special and
    added tokens decode to nothing)."""
    ids = [i for i in range(vocab_size) if i not in eos]
    if tokenizer is not None:
        ids = [i for i in ids if i < tokenizer.vocab_size and tokenizer.decode([i])]
    if not ids:
        raise ValueError("simulate_step_ms: the model's vocabulary has no plain token")
    return ids


class SimOutput(SamplerOutput):
    """Ids that exist at once but are readable only when the simulated step is done."""

    def __init__(self, token_ids: torch.Tensor, done_at: float,
                 logprobs: torch.Tensor | None = None, top_ids: torch.Tensor | None = None,
                 top_logprobs: torch.Tensor | None = None) -> None:
        super().__init__(token_ids, logprobs, top_ids, top_logprobs)
        self.done_at = done_at  # time.monotonic() when the step's "forward" ends

    def ready(self) -> bool:
        return time.monotonic() >= self.done_at and super().ready()

    def left_s(self) -> float:
        return max(0.0, self.done_at - time.monotonic())

    def _get(self, name: str) -> torch.Tensor | None:
        wait = self.done_at - time.monotonic()
        if wait > 0:  # the host sync of a step still running
            time.sleep(wait)
        return super()._get(name)


class SimRunner:
    """ModelRunner's seam (execute, close, followers) without a model."""

    def __init__(self, sim: SimConfig, vocab_size: int, eos_token_ids: frozenset[int],
                 tokenizer: Tokenizer | None) -> None:
        self.sim = sim
        self.followers = None  # never tensor parallel
        self.plain = plain_token_ids(vocab_size, eos_token_ids, tokenizer)
        self._plain_at = {t: i for i, t in enumerate(self.plain)}  # logprobs' alternatives
        self.eos = min(eos_token_ids) if eos_token_ids else None
        self.busy_until = 0.0  # when the simulated device finishes its last launched step
        # set by the engine for a launch whose layers should hear commands (a producer's)
        self.between_layers: Callable[[], None] | None = None

    def token_for(self, seed: int, position: int, may_stop: bool) -> int:
        """The token a request of ``seed`` samples at ``position`` (pure)."""
        k = _key(seed, position)
        if may_stop and self.eos is not None and self.sim.eos_prob > 0 \
                and (_mix(k ^ _EOS_SALT) >> 11) * 2.0 ** -53 < self.sim.eos_prob:
            return self.eos
        return self.plain[k % len(self.plain)]

    def execute(self, chunks: list[ScheduledChunk],
                prev: InflightStep | None) -> tuple[list[Request], SimOutput]:
        """Launches a step of the simulated device; ``prev`` is not needed, since a
        placeholder's value is a pure function too."""
        prefill = sum(c.num_tokens for c in chunks
                      if not (c.num_tokens == 1 and c.start >= c.request.num_prompt_tokens))
        self.busy_until = max(time.monotonic(), self.busy_until) + self.sim.step_s(prefill)
        if prefill and self.sim.prefill_launch_ms:
            self._launch(self.sim.prefill_launch_ms * 1e-3)
            self.busy_until = max(self.busy_until, time.monotonic())
        samplers = [c.request for c in chunks if c.samples]
        # the new token's position is the request's length before its placeholder lands
        ids = [self.token_for(r.seed, r.num_tokens,
                              len(r.output_token_ids) >= r.params.min_tokens)
               for r in samplers]
        tokens = torch.tensor(ids, dtype=torch.int64)
        wants = [r.params.logprobs for r in samplers if r.params.logprobs is not None]
        if not wants:
            return samplers, SimOutput(tokens, self.busy_until)
        return samplers, self._with_logprobs(tokens, max(wants))

    def _launch(self, host_s: float) -> None:
        """Holds the host for host_s as an eager launch does: small torch calls back to
        back, the between-layer hook after each of SIM_LAYERS slices."""
        x = torch.zeros(4)
        one = torch.ones(4)
        start = time.monotonic()
        for layer in range(1, SIM_LAYERS + 1):
            until = start + host_s * layer / SIM_LAYERS
            while time.monotonic() < until:
                for _ in range(20):
                    x = x.add(one)
            if self.between_layers is not None:
                self.between_layers()

    def _with_logprobs(self, tokens: torch.Tensor, top_n: int) -> SimOutput:
        """Made-up logprobs of the right shape: the sampled token best (-1), then the next
        plain ids at -2, -3, ..."""
        n = len(self.plain)
        lps = torch.full((tokens.shape[0],), -1.0)
        if top_n == 0:
            return SimOutput(tokens, self.busy_until, lps)
        at = self._plain_at
        rows = [[t] + [self.plain[(at.get(t, 0) + j) % n] for j in range(1, top_n)]
                for t in tokens.tolist()]
        top_lps = -torch.arange(1, top_n + 1, dtype=torch.float32).expand(len(rows), top_n)
        return SimOutput(tokens, self.busy_until, lps, torch.tensor(rows, dtype=torch.int64),
                         top_lps.contiguous())

    def close(self) -> None:
        pass


def make_runner(config: EngineConfig, model: LlamaForCausalLM | None, kv_cache: torch.Tensor,
                eos_token_ids: frozenset[int], device: torch.device, max_model_len: int,
                tokenizer: Tokenizer | None, vocab_size: int,
                followers: TPFollowers | None = None) -> ModelRunner | SimRunner:
    """The engine's runner: the model's, or a SimRunner for a simulated engine."""
    if config.simulate is not None:
        return SimRunner(config.simulate, vocab_size, eos_token_ids, tokenizer)
    assert model is not None
    return ModelRunner(model, kv_cache, config.block_size, eos_token_ids, device,
                       max_num_seqs=config.max_num_seqs, max_model_len=max_model_len,
                       cuda_graphs=not config.enforce_eager, followers=followers,
                       # a chunk never exceeds the step's token budget
                       prefill_graph_max_tokens=min(config.prefill_graph_max_tokens,
                                                    config.max_num_batched_tokens))
