"""Response filters on literal generation records: each drops what it should, says why, and keeps normal rows."""
from __future__ import annotations

import pytest

from filters.response import RESPONSE_FILTERS, compression_ratio, dup_ngram_fraction, make_response_filters
from regen.config.render import RenderConfig

PROSE = ("Prime numbers are integers greater than one whose only divisors are one and themselves. The first few are "
         "two, three, five, seven and eleven. Every integer above one factors uniquely into primes, which is why "
         "they matter so much in number theory and in cryptography, where large primes keep keys secret.")
FRENCH = ("Les nombres premiers sont des entiers supérieurs à un dont les seuls diviseurs sont un et eux-mêmes. "
          "Les premiers sont deux, trois, cinq, sept et onze, et ils jouent un rôle central en cryptographie.")


def rec(**kw):
    question = "Tell me about prime numbers and why they matter, please, in a few short sentences."
    base = {"messages": [{"role": "user", "content": question}],
            "content": PROSE, "reasoning_content": "The user wants primes.", "tool_calls": None,
            "finish_reason": "stop", "category": "chat", "language": "en"}
    base.update(kw)
    return base


def decide(name, record, **params):
    (f,) = make_response_filters([name], params)
    return f(record)


def test_every_filter_keeps_a_normal_answer():
    params = RenderConfig().filter_params.model_dump()
    params["max_tokens"] = 32768
    for f in make_response_filters(list(RESPONSE_FILTERS), params):
        d = f(rec(num_prompt_tokens=20, num_completion_tokens=80))
        assert d.keep, (f.name, d)


def test_truncated():
    d = decide("truncated", rec(finish_reason="length", num_completion_tokens=64))
    assert not d.keep and d.reason == "finish_reason is 'length': truncated after 64 completion tokens"


def test_empty_answer_but_tool_calls_are_an_answer():
    d = decide("empty_answer", rec(content="  \n", reasoning_content="thought a lot"))
    assert not d.keep and "content is empty" in d.reason and "reasoning_content present" in d.reason
    call = {"id": "c1", "type": "function", "function": {"name": "add", "arguments": "{}"}}
    assert decide("empty_answer", rec(content="", tool_calls=[call])).keep


def test_reasoning_leak():
    d = decide("reasoning_leak", rec(content="<think>hmm</think>The answer is 5."), leak_markers=["<think>", "</think>"])
    assert not d.keep and d.score == 2 and "['<think>', '</think>']" in d.reason


def test_tool_args():
    calls = [
        {"id": "a", "type": "function", "function": {"name": "add", "arguments": '{"a": 1}'}},
        {"id": "b", "type": "function", "function": {"name": "add", "arguments": '{"a": 1'}},
        {"id": "c", "type": "function", "function": {"name": "neg", "arguments": "[1, 2]"}},
        {"id": "d", "type": "function", "function": {"name": "now", "arguments": ""}},
    ]
    d = decide("tool_args", rec(tool_calls=calls))
    assert not d.keep and d.score == 2
    assert "tool_calls[1] (add) arguments are not JSON" in d.reason
    assert "tool_calls[2] (neg) arguments are JSON list, not an object" in d.reason


def test_repetition_loop_in_reasoning():
    loop = "I need to check the answer again. " * 40
    assert dup_ngram_fraction(loop, 10) > 0.9 and dup_ngram_fraction(PROSE, 10) == 0
    d = decide("repetition", rec(reasoning_content=loop), ngram_size=10, max_dup_ngram_fraction=0.5,
               repetition_min_tokens=64)
    assert not d.keep and d.reason.startswith("reasoning_content: 0.9") and "repetition loop" in d.reason
    # a short repeated answer is not scored
    assert decide("repetition", rec(content="yes yes yes yes"), repetition_min_tokens=64).keep


def test_compression_loop():
    loop = "abc def ghi " * 200
    assert compression_ratio(loop) < 0.05 and compression_ratio(PROSE * 3) > 0.1
    d = decide("compression", rec(content=loop), min_compression_ratio=0.08, compression_min_chars=1024)
    assert not d.keep and d.reason.startswith("content compresses to 0.0")
    assert decide("compression", rec(content=PROSE), min_compression_ratio=0.08, compression_min_chars=256).keep


def test_language_mismatch_and_exemptions():
    d = decide("language", rec(content=FRENCH), language_min_chars=80, language_min_prob=0.9)
    assert not d.keep and "answer is in 'fr'" in d.reason and "prompt is in 'en'" in d.reason
    # the prompt's language is detected when the record has none
    d = decide("language", rec(content=FRENCH, language=None), language_min_chars=40, language_min_prob=0.9)
    assert not d.keep and "'en'" in d.reason
    # a translation request, a code category, a short answer and code blocks are not judged
    ask = [{"role": "user", "content": "Translate this paragraph into French please."}]
    assert decide("language", rec(content=FRENCH, messages=ask), language_min_prob=0.9).keep
    assert decide("language", rec(content=FRENCH, category="code"), language_min_prob=0.9).keep
    assert decide("language", rec(content="Oui."), language_min_prob=0.9).keep
    assert decide("language", rec(content="```\n" + FRENCH + "\n```\nDone."), language_min_prob=0.9).keep
    assert decide("language", rec(content=FRENCH, language="fr-FR"), language_min_prob=0.9).keep


def test_over_long_uses_server_counts():
    d = decide("over_long", rec(prompt_token_ids=[1] * 10, completion_token_ids=[2] * 30), max_tokens=32)
    assert not d.keep and d.reason == "prompt + completion is 40 tokens by the server's count (max 32)"
    assert decide("over_long", rec(num_prompt_tokens=10, num_completion_tokens=20), max_tokens=32).keep
    assert decide("over_long", rec(), max_tokens=32).keep  # unknown counts: judged after rendering


def test_unknown_filter_names_the_known_ones():
    with pytest.raises(KeyError, match="truncated"):
        make_response_filters(["nope"], {})
