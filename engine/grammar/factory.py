"""Makes requests' grammar matchers for one engine: llguidance's view of the engine's
tokenizer is built once (0.3 s for a 49k vocabulary; a worker does it before it reports
ready, an in-process LLM on its first structured request) and shared by every matcher."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from engine.grammar.compile import make_tokenizer, new_matcher
from engine.grammar.matcher import RequestGrammar
from engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from engine.tokenizer import Tokenizer


class GrammarFactory:
    def __init__(self, tokenizer: Tokenizer | None, vocab_size: int,
                 eos_ids: frozenset[int]) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_ids = sorted(eos_ids)
        self._ll: Any = None
        self._broken = ""  # why the tokenizer view could not be built (grammars refused)

    def prepare(self) -> None:
        """Builds the tokenizer view now (a worker, before it serves); no-op without a
        tokenizer or once built."""
        if self.tokenizer is None or self._ll is not None or self._broken:
            return
        try:
            self._ll = make_tokenizer(self.tokenizer.to_json(), self.vocab_size, self.eos_ids)
        except Exception as e:  # noqa: BLE001 - the engine serves on, without grammars
            self._broken = f"{type(e).__name__}: {e}"

    def for_params(self, params: SamplingParams) -> RequestGrammar | None:
        """A matcher at the start of the request's grammar (None: unconstrained);
        ValueError naming the problem when it cannot be built."""
        if params.structured is None:
            return None
        if self.tokenizer is None:
            raise ValueError("structured: this engine has no tokenizer to build token masks "
                             "with")
        self.prepare()
        if self._ll is None:
            raise ValueError(f"structured: this engine cannot build token masks for its "
                             f"tokenizer ({self._broken})")
        return RequestGrammar(new_matcher(self._ll, params.structured))
