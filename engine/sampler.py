"""Turns logits into tokens: penalties, min_tokens masking, structured-output masks,
temperature, top-k/p, min-p, and seeded draws that depend only on (seed, position); plus
logprobs with top-N alternatives.

Everything stays on the device: the result is a tensor the next deferred step can consume
before the host has read it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from kernels.bitmask import apply_bitmask
from kernels.random_draw import race, uniform_noise


@dataclass
class SamplingBatch:
    """Per-row sampling inputs for S rows (one per request that samples this step)."""

    temperature: torch.Tensor  # [S] float32; 0 = greedy
    top_k: torch.Tensor  # [S] int64; 0 = off
    top_p: torch.Tensor  # [S] float32
    min_p: torch.Tensor  # [S] float32
    seeds: torch.Tensor  # [S] int64
    positions: torch.Tensor  # [S] int64: position of the token being sampled
    all_greedy: bool
    any_top_k: bool
    any_top_p: bool
    any_min_p: bool
    # Penalties (None when no row has one):
    repetition: torch.Tensor | None = None  # [S] float32
    frequency: torch.Tensor | None = None  # [S] float32
    presence: torch.Tensor | None = None  # [S] float32
    output_counts: torch.Tensor | None = None  # [S, V] float32: output-token counts
    seen_mask: torch.Tensor | None = None  # [S, V] bool: in prompt or output
    banned: torch.Tensor | None = None  # [S, V] bool: EOS/stop ids while under min_tokens
    max_logprobs: int = -1  # -1: no row wants logprobs
    max_top_k: int = 0  # the largest top_k of the batch when known on the host (0: unknown)
    # Structured output: [S, ceil(V / 32)] int32, bit t set when token t is allowed (None when
    # no row has a grammar; rows without one are all ones). engine.grammar.masks builds it.
    allowed: torch.Tensor | None = None


class SamplerOutput:
    """A step's sampled ids (and logprobs), made on the device.

    ``device_token_ids`` stays on the device for the next deferred step's inputs. After
    ``start_host_copy`` the public fields are host copies made asynchronously behind this
    step's kernels: the first read waits for this step alone, not for a step launched
    after it, so the host can read step N while step N+1 runs.
    """

    _FIELDS = ("token_ids", "logprobs", "top_ids", "top_logprobs")

    def __init__(self, token_ids: torch.Tensor, logprobs: torch.Tensor | None = None,
                 top_ids: torch.Tensor | None = None,
                 top_logprobs: torch.Tensor | None = None) -> None:
        self.device_token_ids = token_ids  # [S] int64
        self._dev: dict[str, torch.Tensor | None] = dict(
            token_ids=token_ids, logprobs=logprobs, top_ids=top_ids, top_logprobs=top_logprobs)
        self._host: dict[str, torch.Tensor | None] | None = None
        self._ready: torch.cuda.Event | None = None

    def start_host_copy(self) -> None:
        """Queues the copies to (pinned) host memory on the current stream (CUDA only)."""
        if not self.device_token_ids.is_cuda:
            return
        self._host = {k: None if t is None else t.to("cpu", non_blocking=True)
                      for k, t in self._dev.items()}
        self._ready = torch.cuda.Event()
        self._ready.record()

    def ready(self) -> bool:
        """True once reading the fields would not wait: the step and its copies are done
        (always on CPU, where the forward ran on the host)."""
        return self._ready is None or self._ready.query()

    def left_s(self) -> float:
        """Seconds until ``ready`` when known ahead (a simulated step's); 0: not known."""
        return 0.0

    def _get(self, name: str) -> torch.Tensor | None:
        if self._host is None:
            return self._dev[name]
        if self._ready is not None:
            self._ready.synchronize()  # this step's copies only
            self._ready = None
        return self._host[name]

    @property
    def token_ids(self) -> torch.Tensor:  # [S] int64
        t = self._get("token_ids")
        assert t is not None
        return t

    @property
    def logprobs(self) -> torch.Tensor | None:  # [S] float32: logprob of the sampled token
        return self._get("logprobs")

    @property
    def top_ids(self) -> torch.Tensor | None:  # [S, N] int64
        return self._get("top_ids")

    @property
    def top_logprobs(self) -> torch.Tensor | None:  # [S, N] float32
        return self._get("top_logprobs")


def apply_penalties(logits: torch.Tensor, b: SamplingBatch) -> torch.Tensor:
    if b.repetition is not None and b.seen_mask is not None:
        r = b.repetition[:, None]
        penalized = torch.where(logits > 0, logits / r, logits * r)
        logits = torch.where(b.seen_mask, penalized, logits)
    if b.output_counts is not None:
        if b.frequency is not None:
            logits = logits - b.frequency[:, None] * b.output_counts
        if b.presence is not None:
            logits = logits - b.presence[:, None] * (b.output_counts > 0).float()
    return logits


def _filter(probs: torch.Tensor, b: SamplingBatch) -> torch.Tensor:
    """Zeroes probabilities outside top-k, top-p and min-p; keeps at least the best token."""
    if b.any_min_p:
        keep = probs >= b.min_p[:, None] * probs.max(dim=-1, keepdim=True).values
        probs = probs * keep
    if b.any_top_k and not b.any_top_p and 0 < b.max_top_k < probs.shape[-1] // 2:
        return _top_k_only(probs, b)
    if b.any_top_k or b.any_top_p:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        drop = torch.zeros_like(sorted_p, dtype=torch.bool)
        if b.any_top_k:
            k = torch.where(b.top_k > 0, b.top_k, probs.shape[-1])
            ranks = torch.arange(probs.shape[-1], device=probs.device)
            drop |= ranks[None, :] >= k[:, None]
        if b.any_top_p:
            total = sorted_p.sum(dim=-1, keepdim=True)
            before = sorted_p.cumsum(dim=-1) - sorted_p  # mass strictly above each token
            drop |= before > b.top_p[:, None] * total
        drop[:, 0] = False
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_p)
    return probs


def _top_k_only(probs: torch.Tensor, b: SamplingBatch) -> torch.Tensor:
    """Top-k alone: a partial top-max_top_k selection instead of sorting the vocabulary."""
    vals, idx = probs.topk(b.max_top_k, dim=-1)  # [S, K], best first
    ranks = torch.arange(b.max_top_k, device=probs.device)
    keep = ranks[None, :] < b.top_k[:, None]  # rows with top_k = 0 are restored below
    kept = torch.zeros_like(probs).scatter_(-1, idx, vals * keep)
    return torch.where((b.top_k > 0)[:, None], kept, probs)


def is_simple(b: SamplingBatch) -> bool:
    """Greedy or temperature alone on every row: no filter, penalty, ban or logprobs (a
    structured-output mask is simple: the simple sampler applies it as it reads)."""
    return not (b.any_top_k or b.any_top_p or b.any_min_p or b.max_logprobs >= 0
                or b.banned is not None or b.repetition is not None
                or b.frequency is not None or b.presence is not None)


def sample(logits: torch.Tensor, b: SamplingBatch,
           simple: Callable[..., torch.Tensor] | None = None) -> SamplerOutput:
    """logits: [S, V] float32 -> SamplerOutput (device tensors). ``simple``: a sampler of
    kernels.ref_sample.sample_simple_ref's contract, used when the batch needs no more."""
    if simple is not None and is_simple(b):
        if b.allowed is not None:
            return SamplerOutput(simple(logits, b.temperature, b.seeds, b.positions,
                                        allowed=b.allowed))
        return SamplerOutput(simple(logits, b.temperature, b.seeds, b.positions))
    if b.max_logprobs >= 0:
        # Logprobs describe the model's own distribution, before any sampling transform.
        lp = torch.log_softmax(logits, dim=-1)
    logits = apply_penalties(logits, b)
    if b.banned is not None:
        logits = logits.masked_fill(b.banned, float("-inf"))
    if b.allowed is not None:
        logits = apply_bitmask(logits, b.allowed)
    greedy_ids = logits.argmax(dim=-1)
    if b.all_greedy:
        token_ids = greedy_ids
    else:
        temp = torch.where(b.temperature > 0, b.temperature, 1.0)
        probs = torch.softmax(logits / temp[:, None], dim=-1)
        probs = _filter(probs, b)
        # Exponential race: argmax(p / E), E ~ Exp(1), picks token i with probability p_i.
        expo = -torch.log(uniform_noise(b.seeds, b.positions, logits.shape[-1]))
        drawn = race(probs, expo).argmax(dim=-1)
        token_ids = torch.where(b.temperature > 0, drawn, greedy_ids)
    logprobs = top_lp = top_ids = None
    if b.max_logprobs >= 0:
        logprobs = lp.gather(-1, token_ids[:, None]).squeeze(-1)
        if b.max_logprobs > 0:
            top_lp, top_ids = lp.topk(b.max_logprobs, dim=-1)
    return SamplerOutput(token_ids, logprobs, top_ids, top_lp)
