"""`regen eval`: a draft's acceptance length (acc_len, τ) against its target, under greedy verification (T = 0,
always) and, with `--temperature T` (> 0), under speculative rejection sampling at T (the paper's protocol).

Protocol: shared/docs/dspark.md §7 (DS `eval/base_evaluator.py`). The first output token comes from the prefill
and is not counted; each round verifies `[anchor, d_1…d_K]`, accepts the longest prefix that matches the
target's argmax, and commits one bonus token (the target's argmax at the first mismatch or after d_K), so
`τ_round = accepted + 1`. A stop token accepted at 1-based j ends generation with `τ_round = j` (no bonus); a
stop bonus ends it with `τ_round = accepted + 1`. `acc_len = Σ τ_round / #rounds`; `accept_rate@k` = rounds
with more than k accepted / rounds proposing more than k (a stop cuts the proposal length to j).

Greedy verification is lossless, so the committed text is exactly the target's greedy continuation. We
therefore generate that continuation once per prompt (KV cache), run the target once over prompt +
continuation to get the tap features and the argmax at every position, and replay the rounds against it:
the same rounds and τ as a verify-per-round loop (causality makes the features of committed tokens
identical), at one target pass per prompt. The draft proposes from the features of positions `< anchor`
(spec §2 Inference), recomputing its context each round (no draft KV cache: same numbers, more compute).

Sampling (T > 0, `sampled_rounds`; rule and sources in `regen.train.sampling`): the committed text now depends
on the draws, so each (prompt, draft) is a real speculative generation: the target's prefill, then per round
one draft proposal from the committed features (q_k: the per-slot distributions it drew from) and one cached
target pass over `[anchor, d_1…d_K]` that gives both p_t at the drafted positions and the features of the
positions it commits (the rejected tail is cropped from the KV cache), as DS `generate_decoding_sample` does.
The first token is drawn from the prefill at T and not counted; τ and accept_rate@k count as above. Draws come
from one `torch.Generator` per prompt seeded by (seed, prompt_id): a run is reproducible, and every draft
meets the same random stream on a prompt.

Served protocols (`regen.train.verification`, `run_eval(methods=...)`): the same sampled generation with greedy
drafting (q one-hot on the draft's argmax) and/or block verification (Sun et al. 2024) in place of the token-level
rule, each on the same random streams, under `served` in eval.json.

Held-out prompts: `regen.train.heldout.HeldoutSplit` (a sha256 bucket of the prompt id, `is_heldout`, and per-cell
picks so every cell of the selection is measured); the trainer's feed drops the same prompts (`regen.train.feed`),
so evaluation never sees a trained-on prompt. The prompt of a shard row
is its `input_ids` before the first loss span (first turn, as in DS).
"""
from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass
from pathlib import Path

from regen.train.eval_cells import breakdown, prompt_labels


@dataclass(frozen=True)
class Round:
    """One verification round: `accepted` drafts, `tau` committed tokens, `proposed` (effective) drafts."""

    accepted: int
    tau: int
    proposed: int
    stopped: bool


def score_round(drafts, target_next, stop_ids) -> Round:
    """Greedy verification of one round (spec §7).

    drafts: the K proposed tokens d_1…d_K. target_next: the target's argmax after each verify input
    `[anchor, d_1, …]` (target_next[i] is compared with d_{i+1}; target_next[accepted] is the bonus); it may be
    shorter than K+1 only if it ends in a stop token. stop_ids: the generation config's eos ids.
    """
    stop = set(stop_ids)
    accepted = 0
    for i, d in enumerate(drafts):
        if i >= len(target_next) or int(d) != int(target_next[i]):
            break
        accepted += 1
        if int(d) in stop:  # stop token accepted at j = i + 1: no bonus, generation ends
            return Round(accepted, accepted, accepted, True)
    bonus = int(target_next[accepted])
    return Round(accepted, accepted + 1, len(drafts), bonus in stop)


def summarize(rounds: list[Round], block_size: int) -> dict:
    """{acc_len, num_rounds, accepted_draft_tokens, accept_rate: {"0": …, …, str(K−1): …}} (None where no round
    proposed more than k)."""
    n = len(rounds)
    rates = {}
    for k in range(block_size):
        prop = sum(1 for r in rounds if r.proposed > k)
        acc = sum(1 for r in rounds if r.accepted > k)
        rates[str(k)] = acc / prop if prop else None
    return {"acc_len": sum(r.tau for r in rounds) / n if n else None, "num_rounds": n,
            "accepted_draft_tokens": sum(r.accepted for r in rounds), "accept_rate": rates}


def replay_rounds(propose, sequence: list[int] | None, target_argmax: list[int], prompt_len: int, *,
                  block_size: int, stop_ids, max_new_tokens: int | None = None,
                  n_predict: int | None = None) -> list[Round]:
    """Rounds of speculative greedy decoding replayed against the target's greedy continuation: regen eval's
    protocol, or an engine's budget rule.

    propose(anchor_pos) -> the K draft tokens at that anchor (features of positions < anchor_pos), or None where
    no draft is known (the replay ends). target_argmax[i]: the target's argmax after position i (so
    target_argmax[i] = sequence[i+1] where generated). `sequence`, when given: a prefill token that is a stop
    means no rounds.

    The budget, one of:
    - `max_new_tokens` (regen eval): every round drafts K tokens while fewer than `max_new_tokens` are generated;
    - `n_predict` (llama.cpp's rule, `common/speculative.cpp`): a round at g generated tokens (the prefill token
      counts) drafts min(K, n_predict - g - 1) tokens; none left ends the drafting.
    Either way the replay ends at a stop, or where the known continuation is too short to verify the round.
    """
    if (max_new_tokens is None) == (n_predict is None):
        raise ValueError("replay_rounds: give exactly one of max_new_tokens (regen eval) and n_predict (llama.cpp)")
    stop = set(int(s) for s in stop_ids)
    rounds: list[Round] = []
    pos = prompt_len  # the prefill token: committed, not counted
    if sequence is not None and (pos >= len(sequence) or sequence[pos] in stop):
        return rounds
    while True:
        generated = pos - prompt_len  # after the prefill token
        if n_predict is None:
            if generated >= max_new_tokens:
                break
            k = block_size
        else:
            k = min(block_size, n_predict - (generated + 1) - 1)
            if k <= 0:
                break
        window = target_argmax[pos: pos + k + 1]
        end = next((i + 1 for i, t in enumerate(window) if t in stop), None)
        if end is not None:
            window = window[:end]
        elif len(window) < k + 1:
            break  # not enough known continuation to verify the round
        drafts = propose(pos)
        if drafts is None:
            break
        r = score_round(list(drafts)[:k], window, stop)
        rounds.append(r)
        pos += r.tau
        if r.stopped:
            break
    return rounds


def heldout_prompts(run, heldout, num_prompts: int | None) -> list[dict]:
    """Held-out rows of `run.shards` (one per prompt_id; the first `num_prompts` in `regen.train.heldout.eval_order`,
    round robin over the cells; None = all): {prompt_id, category, prompt_ids, length_band, mode} (band and mode
    from the selection, `regen.train.eval_cells.prompt_labels`). `heldout`: a `regen.train.heldout.HeldoutSplit`,
    or a fraction (the sha256 bucket alone)."""
    import pyarrow.parquet as pq

    from regen.errors import InputError
    from regen.train.heldout import as_split, eval_order

    split = as_split(heldout)
    manifest = run.manifest(run.shards)
    if not manifest or not manifest.get("shards"):
        raise InputError(f"{run.shards}/manifest.json lists no shards: run `regen render` first")
    seen: dict[str, dict] = {}
    for entry in manifest["shards"]:
        t = pq.read_table(run.shards / entry["path"], columns=["prompt_id", "category", "input_ids", "loss_spans"])
        for row in t.to_pylist():
            pid = row["prompt_id"]
            if pid in seen or not row["loss_spans"] or not split(pid):
                continue
            start = row["loss_spans"][0]["start"]
            if start > 0:
                seen[pid] = {"prompt_id": pid, "category": row["category"] or "unknown",
                             "prompt_ids": row["input_ids"][:start]}
    labels = prompt_labels(run)
    ordered = eval_order([{**p, **labels.get(pid, {})} for pid, p in seen.items()])
    return ordered if num_prompts is None else ordered[:num_prompts]


def greedy_continuations(target, prompts_ids: list[list[int]], num_tokens: int, stop_ids) -> list[list[int]]:
    """prompt + greedy continuation (at most `num_tokens` new tokens, through the first of `stop_ids`) for each
    prompt, generated in one left-padded batch: one cached decode of `num_tokens` steps for the whole batch
    instead of one per prompt. The llama.cpp round trip's 8 prompts on SmolLM2 in fp32 (one AMD EPYC core, 57 new
    tokens, with their feature passes): 7.3 s against 19.4 s one at a time, the same tokens, argmax and taps.

    Padding changes the matmuls' shapes, so a row may break a near-tie otherwise than its single-prompt run would:
    `greedy_reference(sequence=...)` cuts every row where it leaves the full pass's argmax, so what is replayed is
    the target's greedy continuation either way (a row may only be shorter)."""
    import torch

    stops = list(stop_ids)
    width = max(map(len, prompts_ids))
    ids = torch.tensor([[stops[0]] * (width - len(p)) + list(p) for p in prompts_ids], device=target.device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts_ids], device=target.device)
    with torch.no_grad():
        out = target.model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=num_tokens,
                                    eos_token_id=stops, pad_token_id=stops[0])
    seqs = []
    for row, p in zip(out.tolist(), prompts_ids):
        new = row[width:]  # a finished row is padded to the longest: keep it through its first stop token
        end = next((k + 1 for k, t in enumerate(new) if t in stops), len(new))
        seqs.append(list(p) + new[:end])
    return seqs


def greedy_reference(target, prompt_ids: list[int], num_tokens: int, stop_ids,
                     sequence: list[int] | None = None) -> tuple[list[int], list[int], object]:
    """(sequence = prompt + greedy continuation, argmax after each position, taps [S, T·Ht]) from the target.

    `sequence`: prompt + continuation already generated (`greedy_continuations`, batched); None generates it
    here, one prompt alone. The continuation is cut where the cached generation and the full-pass argmax
    disagree (near-ties), so the replay only uses positions where both agree.
    """
    import torch

    if sequence is None:
        sequence = greedy_continuations(target, [prompt_ids], num_tokens, stop_ids)[0]
    out = torch.tensor([sequence], device=target.device)
    seq = out[0].tolist()
    taps, last = target.features(out, torch.ones_like(out))
    argmax = target.logits(last[0]).argmax(-1).tolist()
    P = len(prompt_ids)
    for i in range(P, len(seq)):
        if argmax[i - 1] != seq[i]:
            seq = seq[:i]
            break
    return seq, argmax[: len(seq)], taps[0]


def proposal_table(draft, taps_SX, sequence: list[int], first: int, chunk: int = 128,
                   confidence_threshold: float = 0.0) -> list[list[int]]:
    """The draft's greedy block at every anchor position first…len(sequence)−1 (`DSparkDraft.propose_batch`,
    equal to one `propose` per round): list of token lists, index = anchor − first.

    With `confidence_threshold` > 0 a block is cut before the first slot with c_k < threshold (DS static
    threshold, spec §4; a round may then propose nothing and commit one target token); 0 proposes the full
    block (DS default)."""
    import torch

    dev = next(draft.parameters()).device
    ids = torch.tensor([sequence], device=dev)
    taps = taps_SX[None].to(dev)
    out: list[list[int]] = []
    for start in range(first, len(sequence), chunk):
        anchors = torch.arange(start, min(start + chunk, len(sequence)), device=dev)[None]
        tokens, conf = draft.propose_batch(taps, ids, anchors)
        for toks, cs in zip(tokens[0].tolist(), conf[0].tolist()):
            cut = next((k for k, c in enumerate(cs) if c < confidence_threshold), len(toks))
            out.append(toks[:cut])
    return out


class TargetSession:
    """A target generation under speculative decoding: a KV cache and the tap features of committed positions.

    `prefill(prompt_ids)` -> logits float32[V] after the prompt; `verify(ids)` -> logits float32[len(ids), V]
    after each of `ids` (appended to the cache); `keep(n)` commits positions < n (the rest of the last verify is
    dropped from the cache). `taps` float[n, T·Ht]: the features of the committed positions.
    """

    def __init__(self, target):
        self.target = target
        self.cache = None
        self.ids: list[int] = []
        self.taps = None
        self._pending = None

    def _run(self, ids: list[int]):
        import torch

        x = torch.tensor([ids], device=self.target.device)
        taps, last = self.target.features(x, past_key_values=self.cache)
        self.ids.extend(int(i) for i in ids)
        return taps[0], self.target.logits(last[0])

    def prefill(self, prompt_ids: list[int]):
        from transformers import DynamicCache

        self.cache, self.ids = DynamicCache(), []
        self.taps, logits = self._run(list(prompt_ids))
        return logits[-1]

    def verify(self, ids: list[int]):
        self._pending, logits = self._run(ids)
        return logits

    def keep(self, n: int) -> None:
        import torch

        have = self.taps.shape[0]
        self.taps = torch.cat([self.taps, self._pending[: n - have]]) if n > have else self.taps[:n]
        drop = len(self.ids) - n
        self.ids = self.ids[:n]
        if drop > 0:
            self.cache.crop(-drop)
            if self.cache.get_seq_length() != n:  # a cache layer that cannot roll back: rebuild from the ids
                from transformers import DynamicCache

                self.cache, ids = DynamicCache(), self.ids
                self.ids = []
                self._run(ids)


def sampled_rounds(propose, session, prompt_ids: list[int], *, max_new_tokens: int, temperature: float,
                   top_p: float, stop_ids, generator, verify=None) -> tuple[list[Round], list[int]]:
    """Speculative sampling of one generation (module docstring): (rounds, prompt + generated token ids).

    propose(anchor_pos, ids) -> (draft tokens list[int], q float[k, V]: the distribution each was drawn from),
    with the committed features in `session.taps` (positions < anchor_pos); session: a `TargetSession` (or any
    object with its prefill / verify / keep). Stops at a stop token or after `max_new_tokens` generated tokens.
    verify: the round's rule (`regen.train.verification.verifier`; default token-level `verify_sampled`).
    """
    from regen.train.sampling import draw, sampling_probs, verify_sampled

    verify = verify or verify_sampled

    stop = set(int(t) for t in stop_ids)
    P = len(prompt_ids)
    seq = list(prompt_ids) + [draw(sampling_probs(session.prefill(prompt_ids), temperature, top_p), generator)]
    rounds: list[Round] = []
    pos = P  # the prefill token: committed, not counted
    if seq[pos] in stop:
        return rounds, seq
    while pos - P < max_new_tokens:
        drafts, q = propose(pos, seq)
        p = sampling_probs(session.verify([seq[pos], *drafts]), temperature, top_p)
        v = verify(drafts, q, p, stop, generator)
        rounds.append(Round(v.accepted, v.tau, v.proposed, v.stopped))
        session.keep(pos + v.accepted + 1)  # the anchor and the accepted drafts are committed
        seq = seq[: pos + 1] + list(drafts[: v.accepted]) + ([v.bonus] if v.bonus is not None else [])
        pos += v.tau
        if v.stopped:
            break
    return rounds, seq


def evaluation_loop(drafts: dict, prompts: list[dict], rounds_of, *, block_size: int,
                    progress: str | None = None) -> dict:
    """The one loop of greedy (`evaluate`) and sampled (`evaluate_sampled`) verification.

    rounds_of(prompt) -> ({draft name: list[Round]}, note): every draft's rounds on one prompt (`note` is appended
    to the progress line). Returns {name: {acc_len, num_rounds, accept_rate, per_category: {cat: figures},
    breakdown: per category x length band x mode (`regen.train.eval_cells`), acc_len_per_request}}.
    """
    by_category = {name: {} for name in drafts}
    requests = {name: [] for name in drafts}  # (prompt, its rounds): the per-cell breakdown
    for n, p in enumerate(prompts):
        rounds, note = rounds_of(p)
        for name in drafts:
            by_category[name].setdefault(p["category"], []).extend(rounds[name])
            requests[name].append((p, rounds[name]))
        if progress:
            print(f"{progress}: prompt {n + 1}/{len(prompts)}{note}", flush=True)
    result = {}
    for name, by_cat in by_category.items():
        every = [r for rs in by_cat.values() for r in rs]
        result[name] = summarize(every, block_size)
        result[name]["per_category"] = {c: summarize(rs, block_size) for c, rs in sorted(by_cat.items())}
        result[name]["breakdown"] = breakdown(requests[name], block_size)
        result[name]["acc_len_per_request"] = result[name]["breakdown"]["overall"]["acc_len_per_request"]
    return result


def evaluate_sampled(target, drafts: dict, prompts: list[dict], *, max_new_tokens: int, stop_ids,
                     temperature: float, top_p: float = 1.0, seed: int = 0, confidence_threshold: float = 0.0,
                     progress: bool = False, draft_sample_method: str = "probabilistic",
                     rejection_sample_method: str = "standard") -> dict:
    """acc_len of each draft under rejection sampling at (temperature, top_p); same result shape as `evaluate`.

    Each (prompt, draft) generation draws from a generator seeded by (seed, prompt_id). A block is cut before
    the first slot with confidence < `confidence_threshold` (spec §4), its q rows with it. The served protocol
    (`regen.train.verification`): draft_sample_method "probabilistic" (drafts drawn at T) or "greedy" (the
    draft's argmax, q one-hot); rejection_sample_method "standard" (token-level) or "block" (Sun et al. 2024).
    """
    import torch

    from regen.train.verification import verifier

    verify = verifier(rejection_sample_method)
    draft_t = temperature if draft_sample_method == "probabilistic" else 0.0  # greedy drafting: q one-hot

    def rounds_of(p):
        out = {}
        for name, draft in drafts.items():
            gen = torch.Generator(device=target.device)
            key = hashlib.blake2b(f"{seed}:{p['prompt_id']}:eval-sampling".encode(), digest_size=8).digest()
            gen.manual_seed(int.from_bytes(key, "little") & ((1 << 62) - 1))
            session = TargetSession(target)

            def propose(pos, seq, draft=draft, session=session, gen=gen):
                toks, conf, q = draft.propose(session.taps.to(next(draft.parameters()).device), seq[pos], pos,
                                              temperature=draft_t, top_p=top_p, generator=gen,
                                              return_probs=True)
                cut = next((k for k, c in enumerate(conf.tolist()) if c < confidence_threshold), len(toks))
                return toks[:cut].tolist(), q[:cut].to(target.device)

            out[name], _ = sampled_rounds(propose, session, p["prompt_ids"], max_new_tokens=max_new_tokens,
                                          temperature=temperature, top_p=top_p, stop_ids=stop_ids, generator=gen,
                                          verify=verify)
        return out, ""

    block_size = max(1, next(iter(drafts.values())).config.block_size)
    return evaluation_loop(drafts, prompts, rounds_of, block_size=block_size,
                           progress=f"eval T={temperature:g}" if progress else None)


def evaluate(target, drafts: dict, prompts: list[dict], *, max_new_tokens: int, stop_ids, block_size: int,
             confidence_threshold: float = 0.0, progress: bool = False) -> dict:
    """acc_len of each draft in `drafts` ({name: DSparkDraft}) over `prompts` (see `heldout_prompts`) under greedy
    verification: one target pass per prompt (`greedy_reference`), each draft's rounds replayed against it.

    Returns `evaluation_loop`'s figures: {name: {acc_len, num_rounds, accept_rate, per_category, breakdown, ...}}.
    """
    def rounds_of(p):
        seq, argmax, taps = greedy_reference(target, p["prompt_ids"], max_new_tokens + block_size + 1, stop_ids)
        P = len(p["prompt_ids"])
        out = {}
        for name, draft in drafts.items():
            table = proposal_table(draft, taps, seq, P, confidence_threshold=confidence_threshold)
            out[name] = replay_rounds(lambda pos, table=table: table[pos - P], seq, argmax, P,
                                      max_new_tokens=max_new_tokens, block_size=block_size, stop_ids=stop_ids)
        return out, f" ({len(seq) - P} tokens)"

    return evaluation_loop(drafts, prompts, rounds_of, block_size=block_size, progress="eval" if progress else None)


def served_protocols(target, drafts: dict, prompts: list[dict], methods, sampled: dict, **kw) -> dict:
    """{"<draft>+<rejection>": {protocol, <draft name>: figures}} for each served protocol in `methods` at the
    sampled T (`evaluate_sampled`); the default pair reuses `sampled` (the same streams give the same rounds)."""
    from regen.train.verification import DEFAULT_METHOD, METHOD_DESCRIPTIONS, method_key

    proto, out = sampled["protocol"], {}
    for dm, rm in methods:
        res = {k: v for k, v in sampled.items() if k != "protocol"} if (dm, rm) == DEFAULT_METHOD else evaluate_sampled(
            target, drafts, prompts, temperature=proto["temperature"], top_p=proto["top_p"], seed=proto["seed"],
            draft_sample_method=dm, rejection_sample_method=rm, **kw)
        out[method_key(dm, rm)] = {"protocol": {**proto, "draft_sample_method": dm, "rejection_sample_method": rm,
                                                "verification": METHOD_DESCRIPTIONS[rm],
                                                "draft_proposal": METHOD_DESCRIPTIONS[dm]}, **res}
    return out


RESERVED_NAMES = frozenset({"trained", "untrained", "num_prompts", "num_prompts_asked", "seed", "draft",
                            "draft_sha256", "target", "heldout_fraction", "max_new_tokens", "block_size",
                            "markov_rank", "stop_token_ids", "temperature", "drafts", "confidence_threshold",
                            "protocol", "elapsed_s", "sampled", "top_p", "rope_theta", "served"})

GREEDY_PROTOCOL = "greedy verification, bonus token counted, first (prefill) token not counted (spec §7)"
SAMPLED_VERIFICATION = (
    "speculative rejection sampling (Leviathan et al. 2023, arXiv 2211.17192; Chen et al. 2023, arXiv 2302.01318; "
    "DS eval/base_evaluator.py::verify_draft_tokens): d_k accepted with probability min(1, p_t(d_k)/q_k(d_k)) in "
    "order; on the first rejection the bonus token is drawn from norm(max(0, p_t - q_k)); after all accepted, "
    "from p_t; bonus counted, first (prefill) token drawn at T and not counted (spec §7)")
DRAFT_PROPOSAL = ("q_k = softmax((U_k + W2·W1[x_(k-1)]) / T) restricted to the top-p nucleus, x_(k-1) the token "
                  "drawn at slot k-1 (x_0 = anchor): the distribution each draft token is drawn from (spec §2, §3)")


def run_eval(cfg, run, *, draft_dir, seed: int | None = None, num_prompts: int = 32, max_new_tokens: int = 64,
             confidence_threshold: float = 0.0, progress: bool = True, compare: dict | None = None,
             out_path: str | Path | None = None, temperature: float = 0.0, top_p: float = 1.0,
             methods: list[tuple[str, str]] | None = None) -> dict:
    """Measure the trained draft in `draft_dir` and an untrained draft of the same config (seeded) on the run's
    held-out prompts; write `out_path` (default `run.eval_json`: `<run>/eval.json`, or `eval-original.json` for
    `run.with_responses("original")`) atomically and return it.

    The top-level figures are greedy (T = 0, unchanged); with temperature > 0 the same drafts are also measured
    under rejection sampling at (temperature, top_p), under `"sampled"`: {protocol, <draft name>: {acc_len,
    accept_rate, per_category, ...}}, seeded by `seed`. InputError for temperature < 0 or top_p outside (0, 1],
    and when the profile's `train.rope_theta` differs from a checkpoint's. `methods`: further served protocols
    [(draft_sample_method, rejection_sample_method)] (`regen.train.verification`) measured at the same T on the
    same random streams, under `"served"`: {"<draft>+<rejection>": {protocol, <draft name>: {...}}}; "sampled" is
    ("probabilistic", "standard").

    compare: {name: draft dir} of further trained drafts of the same target and block size measured on the same
    prompts and reported under their names (e.g. {"markov_rank_0": ...}, the spec §9 ablation); InputError for
    a reserved name (`RESERVED_NAMES`), a missing dir or another block size, before the target loads.

    cfg: TrainConfig (target path, heldout_fraction, seed); run: RunDir. Raises InputError for a missing
    target, draft or shards, and ContractError when the profile's tap contract differs from the draft's.
    """
    import torch

    from regen.config import resolve_path
    from regen.errors import InputError
    from regen.train.model import DSparkDraft, load_draft
    from regen.train.target import TargetContract, TargetFeatures
    from schemas.io import sha256_file, write_json_atomic

    t0 = time.perf_counter()
    if temperature < 0 or not 0 < top_p <= 1:
        raise InputError(f"--temperature {temperature} --top-p {top_p}: use T >= 0 (0 = greedy only) and top_p in "
                         "(0, 1]")
    from regen.train.checkpoint import find_draft, load_servable_weights

    ddir = find_draft(draft_dir)
    from regen.train.draft_config import check_rope_theta

    load_servable_weights(ddir)  # refuses a damaged (MANIFEST.json) or non-finite draft, as the exports do
    from regen.train.model import DSparkConfig

    dcfg = DSparkConfig.from_json(ddir / "config.json")
    expected_theta = getattr(cfg, "rope_theta", None)
    check_rope_theta(dcfg, expected_theta, checkpoint=str(ddir / "config.json"),
                     expected_from="the profile's train.rope_theta")
    contract = TargetContract.from_draft_config(dcfg)
    others = {}  # checked before the target loads: a typo costs seconds, not a model load
    for name, other in (compare or {}).items():
        if name in RESERVED_NAMES:
            raise InputError(f"--compare {name}=...: {name!r} is a reserved key of eval.json; choose another name")
        odir = find_draft(other, f"--compare {name}=")
        load_servable_weights(odir)
        ocfg = DSparkConfig.from_json(odir / "config.json")
        check_rope_theta(ocfg, expected_theta, checkpoint=f"--compare {name}={other}",
                         expected_from="the profile's train.rope_theta")
        contract.check(TargetContract.from_draft_config(ocfg), f"--compare {name}={other}")
        if ocfg.block_size != dcfg.block_size:
            raise InputError(f"--compare {name}={other}: block_size {ocfg.block_size} differs from the draft's "
                             f"{dcfg.block_size}; compare drafts of one block size")
        others[name] = odir
    from regen.train.heldout import eval_heldout_split, first_selection_cells

    held, heldout = eval_heldout_split(run, getattr(cfg, "heldout_fraction", 0.05),
                                       getattr(cfg, "heldout_per_cell", 0), {"trained": ddir, **others})
    fraction = held.fraction
    if cfg.target_layer_ids:
        contract.check({"target_layer_ids": list(cfg.target_layer_ids),
                        "aux_hidden_stream": cfg.aux_hidden_stream}, "the profile's train section")
    if not cfg.target:
        raise InputError("train.target is not set: give the local path of the target model")
    want = getattr(cfg, "device", "auto")
    dev = "cuda" if want in ("auto", "cuda") and torch.cuda.is_available() else "cpu"
    target = TargetFeatures.from_pretrained(resolve_path(cfg.target), contract, device=dev)
    seed = seed if seed is not None else (cfg.seed if getattr(cfg, "seed", None) is not None else 0)
    trained = load_draft(ddir, target_model=target.model).to(dev).eval()
    torch.manual_seed(seed)
    untrained = DSparkDraft.from_target(target.model, dcfg, draft_vocab=trained.draft_vocab()).to(dev).eval()
    drafts = {"trained": trained, "untrained": untrained}
    for name, odir in others.items():
        drafts[name] = load_draft(odir, target_model=target.model).to(dev).eval()
    gen = getattr(target.model, "generation_config", None)
    eos = getattr(gen, "eos_token_id", None) if gen is not None else None
    stop = sorted({*(eos if isinstance(eos, (list, tuple)) else ([eos] if eos is not None else [])),
                   *dcfg.eos_token_id})
    split = heldout_prompts(run, held, None)
    prompts = split[:num_prompts]
    measured = {(p.get("category") or "unknown", p.get("length_band"), p.get("mode")) for p in prompts}
    selected = {(c or "unknown", b, m) for c, b, m in first_selection_cells(run).values()}
    heldout.update(num_heldout_prompts=len(split), num_evaluated=len(prompts),
                   which="the first num_prompts held-out prompts, round robin over the cells, each cell's by "
                         "sha256(prompt_id) (regen.train.heldout.eval_order)",
                   cells_selected=len(selected), cells_measured=len(measured & selected),
                   cells_not_measured=[list(c) for c in sorted(selected - measured, key=lambda c: tuple(map(str, c)))])
    if not prompts:
        raise InputError(f"no held-out prompts in {run.shards} at heldout_fraction={fraction}: raise "
                         "train.heldout_fraction or train.heldout_per_cell (and retrain) or add prompts")
    res = evaluate(target, drafts, prompts, max_new_tokens=max_new_tokens,
                   stop_ids=stop, block_size=dcfg.block_size, confidence_threshold=confidence_threshold,
                   progress=progress)
    sampled = None
    if methods and temperature <= 0:
        raise InputError("--draft-sample-method / --rejection-sample-method measure at T > 0: give --temperature "
                         "(the card's sampled endpoint: 1.0); at T = 0 every method is greedy verification")
    if temperature > 0:
        sampled = {"protocol": {"temperature": temperature, "top_p": top_p, "seed": seed,
                                "verification": SAMPLED_VERIFICATION, "draft_proposal": DRAFT_PROPOSAL,
                                "random_streams": "one torch.Generator per prompt, seeded by (seed, prompt_id)"},
                   **evaluate_sampled(target, drafts, prompts, max_new_tokens=max_new_tokens, stop_ids=stop,
                                      temperature=temperature, top_p=top_p, seed=seed,
                                      confidence_threshold=confidence_threshold, progress=progress)}
        served = served_protocols(target, drafts, prompts, methods or [], sampled, max_new_tokens=max_new_tokens,
                                  stop_ids=stop, confidence_threshold=confidence_threshold, progress=progress)
    target.close()
    dirs = {"trained": ddir, "untrained": ddir, **others}
    out = {**res, "num_prompts": len(prompts), "num_prompts_asked": num_prompts, "seed": seed, "draft": str(ddir),
           "draft_sha256": sha256_file(ddir / "model.safetensors"), "target": str(cfg.target),
           "heldout_fraction": fraction, "heldout": heldout, "max_new_tokens": max_new_tokens, "block_size": dcfg.block_size,
           "markov_rank": dcfg.markov_rank, "rope_theta": dcfg.rope_theta, "stop_token_ids": stop,
           "temperature": 0.0,
           "drafts": {name: {"dir": str(dirs[name]), "markov_rank": d.config.markov_rank,
                             "draft_vocab_size": d.config.draft_vocab_size, "trained": name != "untrained"}
                      for name, d in drafts.items()},
           "confidence_threshold": confidence_threshold,
           "protocol": GREEDY_PROTOCOL, **({"sampled": sampled, "served": served} if sampled else {}),
           "elapsed_s": round(time.perf_counter() - t0, 2)}
    write_json_atomic(out, Path(out_path) if out_path else run.eval_json)
    if getattr(cfg, "tracking", None):  # the figures to the draft's TensorBoard too (regen.train.tracking)
        from regen.train.tracking import track_eval

        track_eval(out, ddir, run, cfg)
    return out
