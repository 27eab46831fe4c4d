"""Stage 2, generate: `prompts/` -> `generations/` (GENERATION_SCHEMA), one row per (prompt_id, turn) unit.

In:  the selected prompts; OpenAI-compatible `/v1/chat/completions` endpoints (the target).
Out: `generations/part-*.parquet` (status ok | error | skipped, with the server's token ids when given),
     the request ledger, `manifest.json` with the accounting generated + error + skipped == units.

Modules, in reading order:
    conversation.py  where assistant turns are generated, each request's body and its content-hash key
    endpoints.py     before the first request: every endpoint answers /models, accepts the key, lists the model
    client.py        the transport: endpoint pool, timeouts, backoff with Retry-After, 429 cooldown
    wire.py          what an answer's bytes mean: JSON bodies, SSE streams, error objects inside a 200, tool deltas
    concurrency.py   max_in_flight auto: each endpoint's in-flight limit from throughput, TTFT, 429/503, /metrics
    checks.py        what a "200 OK" must be: failure classes, the finish_reason allow-list, text past the end,
                     usage that contradicts itself
    ledger.py        exactly-once storage: fsynced journal -> atomic Parquet parts -> ledger; sha256 checks
                     (`verify_parts`, `check_parts`), repair and supersede into quarantine/
    metrics.py       live progress, the metrics summary, per-minute throughput
    runner.py        one process's share: conversation workers over one client and one ledger
    ray_runner.py    the same run split across Ray actors (loopback unless given a cluster)
    recheck.py       --recheck: the ok rows already held, judged by the current checks
    stage.py         the stage: resume checks (request config, policies), --repair, --recheck, --retry-errors,
                     accounting, `complete(cfg, run)` (nothing left to ask)
    preflight.py     `check(cfg, run, rep)`: before a run, the endpoints and the key; `check_started` of a server
                     the caller started

Entry point: `regen.generate.stage.run_generate(cfg: GenerateConfig, run: RunDir)`; CLI `regen generate`;
its check before a run: `regen.generate.preflight.check(cfg, run, rep)`.
For readers of generations/ (render, query): `regen.generate.ledger.check_parts(gen_dir)` verifies every listed part.
"""
