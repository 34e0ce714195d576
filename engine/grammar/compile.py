"""A structured-output spec to an llguidance grammar, and the checks that bound its cost.

Why llguidance (bench/RESULTS.md, "Structured output: grammar library"): it builds a
schema's grammar lazily (2 ms for a 40-field order schema on SmolLM2's 49k vocabulary,
where xgrammar precomputes a token-mask cache for 1.3 s), its work is bounded by fuel
limits rather than wall-clock timers, and it imports no torch, so the router validates a
request with the same library and limits a worker compiles it with. Its per-token mask
(16 us median per row) is computed on the host while the device runs the step's forward.

Torch-free; llguidance is imported on first use so a router that never sees a structured
request does not load it.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from engine.grammar.spec import check_spec, choices_of

if TYPE_CHECKING:
    import llguidance

# llguidance's own fuel units. Building the lexer spends ~50k/ms, so 1M bounds the compile
# of any grammar to ~20 ms; a mask step spends ~14k/ms, so 200k bounds a row's mask to
# ~15 ms (typical JSON rows take 16 us). A grammar past either limit is refused (compile)
# or ends its request with an error state (step) instead of stalling the loop.
INITIAL_LEXER_FUEL = 1_000_000
STEP_LEXER_FUEL = 200_000
MAX_GRAMMAR_SIZE = 500_000


def limits() -> llguidance.LLParserLimits:
    import llguidance

    return llguidance.LLParserLimits(initial_lexer_fuel=INITIAL_LEXER_FUEL,
                                     step_lexer_fuel=STEP_LEXER_FUEL,
                                     max_grammar_size=MAX_GRAMMAR_SIZE, verbose_errors=False)


def grammar_of(spec: dict[str, str], field: str = "structured") -> str:
    """The llguidance grammar text of a spec (shape-checked first)."""
    import llguidance

    check_spec(spec, field)
    kind, value = spec["kind"], spec.get("value", "")
    m = llguidance.LLMatcher
    if kind == "json_object":
        return m.grammar_from_json_schema({"type": "object"})
    if kind == "json_schema":
        try:
            return m.grammar_from_json_schema(value)
        except ValueError as e:
            raise ValueError(f"{field}.value: {e}") from e
    if kind == "regex":
        return m.grammar_from_regex(value)
    if kind == "choice":
        alts = " | ".join(json.dumps(c, ensure_ascii=False) for c in choices_of(spec))
        return m.grammar_from_lark(f"start: {alts}")
    return m.grammar_from_lark(value)


def check_compiles(spec: dict[str, str], field: str = "structured",
                   tokenizer: llguidance.LLTokenizer | None = None) -> None:
    """ValueError naming the problem when the spec's grammar is invalid or over the limits
    (compiled with them, so the time this takes is bounded too)."""
    import llguidance

    grammar = grammar_of(spec, field)
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(
        grammar, tokenizer, limits=limits())
    if is_error:
        raise ValueError(f"{field}: {_first_line(messages[0])}")


def new_matcher(tokenizer: llguidance.LLTokenizer, spec: dict[str, str],
                field: str = "structured") -> llguidance.LLMatcher:
    """A matcher at the start of the spec's grammar; ValueError when it does not compile."""
    import llguidance

    m = llguidance.LLMatcher(tokenizer, grammar_of(spec, field), limits=limits(), log_level=0)
    if m.is_error():
        raise ValueError(f"{field}: {_first_line(m.get_error())}")
    return m


def make_tokenizer(tokenizer_json: str, vocab_size: int, eos_ids: list[int]) -> Any:
    """llguidance's view of a ``tokenizers`` tokenizer (its JSON), padded to the model's
    vocabulary (a mask row covers every logit) with its end-of-sequence ids."""
    import llguidance

    return llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=eos_ids)


def _first_line(msg: str) -> str:
    """The library's message on one line (it spans several, with a caret under the spot)."""
    flat = " ".join(msg.split())
    return (flat[:300] + "...") if len(flat) > 300 else (flat or "invalid grammar")
