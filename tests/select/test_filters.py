"""Prompt filters on literal records: scores, decisions and the reasons they give; MinHash near dedup."""
from __future__ import annotations

import random
from dataclasses import dataclass, field

import numpy as np
from select_helpers import perturb

from filters.dedup import MinHasher, lsh_params, near_duplicates
from filters.prompt import (
    ContaminationFilter,
    ContaminationIndex,
    EmptyFilter,
    ExactDedupFilter,
    ImageOnlyFilter,
    TokenBudgetFilter,
    ToolSchemaFilter,
    prompt_tokens,
)
from filters.text import estimate_tokens, normalize_text


@dataclass
class Rec:
    messages: list
    tools: list | None = None
    prompt_id: str = "p0"
    text: str = ""
    extra: dict = field(default_factory=dict)


def user(text):
    return Rec([{"role": "user", "content": text}])


def test_empty():
    f = EmptyFilter(1)
    d = f(user(" \n\t "))
    assert not d.keep and d.score == 0 and "empty or whitespace" in d.reason
    assert f(user("hi")).keep
    img = Rec([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "u"}}]}])
    assert f(img).keep  # an image prompt is the image filter's business


def test_image_only():
    only = Rec([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "u"}}]}])
    both = Rec([{"role": "user", "content": [{"type": "text", "text": "what is this?"},
                                             {"type": "image_url", "image_url": {"url": "u"}}]}])
    d = ImageOnlyFilter()(only)
    assert not d.keep and "only images" in d.reason
    assert ImageOnlyFilter()(both).keep
    d = ImageOnlyFilter(drop_any_image=True)(both)
    assert not d.keep and "drop_prompts_with_images" in d.reason
    assert ImageOnlyFilter(drop_any_image=True)(user("text")).keep


def _tool(name="get_weather", params=None):
    return {"type": "function", "function": {"name": name, "description": "d",
                                             "parameters": params or {"type": "object",
                                                                       "properties": {"city": {"type": "string"}},
                                                                       "required": ["city"]}}}


def test_tool_schema():
    f = ToolSchemaFilter()
    assert f(Rec([{"role": "user", "content": "x"}], [_tool()])).keep
    cases = [
        ([_tool(params={"type": "object", "properties": {"c": {"type": "dict"}}})], "'dict' is not a JSON Schema type"),
        ([_tool(name="bad name!")], "must match"),
        ([_tool(), _tool()], "declared twice"),
        ([_tool(params={"type": "object", "properties": {}, "required": ["zip"]})], "not in properties"),
        ([_tool(params={"type": "array"})], "expected 'object'"),
        ([{"type": "function"}], "is not {type: function"),
    ]
    for tools, want in cases:
        d = f(Rec([{"role": "user", "content": "x"}], tools))
        assert not d.keep and want in d.reason, (want, d.reason)
    call = {"role": "assistant", "content": None,
            "tool_calls": [{"id": "c", "type": "function", "function": {"name": "other", "arguments": "{}"}}]}
    d = f(Rec([{"role": "user", "content": "x"}, call, {"role": "tool", "content": "r", "tool_call_id": "c"}], [_tool()]))
    assert not d.keep and "not among the declared tools" in d.reason


def test_token_budget_estimate():
    assert estimate_tokens("abcd" * 10) == 10
    assert estimate_tokens("你好世界") == 4
    f = TokenBudgetFilter(10)
    short, long = user("word " * 8), user("word " * 100)
    short.num_prompt_tokens, long.num_prompt_tokens = prompt_tokens(short), prompt_tokens(long)
    assert f(short).keep
    d = f(long)
    assert not d.keep and "125 tokens" in d.reason and "budget of 10" in d.reason


def test_contamination_exact_and_ngram():
    bench = "Compose an engaging travel blog post about a recent trip to Hawaii, highlighting cultural experiences " \
            "and must-see attractions."
    idx = ContaminationIndex([bench], ngram=5)
    f = ContaminationFilter(idx, 0.5)
    d = f(user(bench.upper() + "  "))
    assert not d.keep and d.score == 1.0 and "matches a benchmark prompt" in d.reason
    d = f(user("Please: " + bench.replace("Hawaii", "Fiji")))
    assert not d.keep and 0.5 <= d.score < 1 and "5-word n-grams" in d.reason
    assert f(user("Write a poem about the sea and the wind over the hills tonight")).keep
    assert ContaminationFilter(None)(user(bench)).keep


def test_exact_dedup_normalizes_and_names_the_first():
    f = ExactDedupFilter()
    a = Rec([{"role": "user", "content": "Hello   World"}], prompt_id="first")
    b = Rec([{"role": "user", "content": "hello world\n"}], prompt_id="second")
    c = Rec([{"role": "user", "content": "hello world"}], [_tool()], prompt_id="third")
    assert f(a).keep
    d = f(b)
    assert not d.keep and "of prompt first" in d.reason
    assert f(c).keep  # same text, different tools: not a duplicate
    assert normalize_text("Ｈｅｌｌｏ\u3000 World") == "hello world"


def test_minhash_estimates_jaccard_like_datasketch():
    from datasketch import MinHash

    rng = random.Random(0)
    base = ("Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
            "How many clips did Natalia sell altogether in April and May?")
    mh = MinHasher(num_perm=256)
    for n_changes in (1, 3, 10, 40):
        other = perturb(base, n_changes, rng)
        a, b = normalize_text(base), normalize_text(other)
        sa = {a[i:i + 5] for i in range(len(a) - 4)}
        sb = {b[i:i + 5] for i in range(len(b) - 4)}
        true = len(sa & sb) / len(sa | sb)
        sig = mh.signatures([base, other])
        ours = (sig[0] == sig[1]).mean()
        m1, m2 = MinHash(num_perm=256), MinHash(num_perm=256)
        m1.update_batch([s.encode() for s in sa])
        m2.update_batch([s.encode() for s in sb])
        assert abs(ours - true) < 0.12, (n_changes, ours, true)
        assert abs(m1.jaccard(m2) - true) < 0.12
    assert lsh_params(0.8, 128) == (9, 13)


def test_near_duplicates_found_and_distinct_kept():
    rng = random.Random(1)
    texts = [f"Question {i}: a farmer has {i * 7 + 3} sheep and buys {i + 11} goats at the market on {d}. "
             f"How many animals does the farmer own now, and how many legs do they have?"
             for i, d in zip(range(50), ["Monday", "Tuesday", "Friday"] * 20)]
    distinct = ["Explain the difference between TCP and UDP in networking, with an example of an application "
                "that should use each one and the reasons for the choice.",
                "Write a haiku about autumn leaves falling into a quiet pond, then explain the seasonal word you "
                "chose and how the syllables are counted.",
                "What is the capital of Australia and why was it chosen over Sydney and Melbourne when the "
                "federation was formed?"]
    planted = [perturb(distinct[0], 2, rng), distinct[1].replace("autumn", "Autumn!")]
    sig = MinHasher().signatures(distinct + planted + texts[:1])
    dup, match, jac = near_duplicates(sig, 0.8)
    assert dup.tolist() == [3, 4] and match.tolist() == [0, 1] and (jac >= 0.8).all()
    assert near_duplicates(np.zeros((1, 128), dtype=np.uint32), 0.8)[0].size == 0
