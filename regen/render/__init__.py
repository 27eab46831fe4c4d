"""Stage 3, render: `generations/` -> response filters -> `shards/shard-*.parquet` (SHARD_SCHEMA) + manifest.

In:  generation rows (read through `schemas.generation`), the target's tokenizer and conversation format.
Out: token shards with `input_ids` and an assistant-only `loss_mask`, `shards/manifest.json` stating the
     training contract (tokenizer hash, renderer, max length, mask policy), `rejected/render/`.

A sample's ids: the prompt ids exactly as the target saw them, then the answer's ids, turn by
turn. Prompt = the generation prompt (`messages[:k]` + `add_generation_prompt=True`) rendered and tokenized alone,
or the server's `prompt_token_ids`; answer = its text tokenized alone, or the server's `completion_token_ids`;
then the template's closing tail. No token straddles a prompt/answer boundary (`Renderer.render(...,
last_only=True)` builds a row's sample; `render(messages[:k], add_generation_prompt=True).input_ids` is the prefix
before turn k's answer). Renderers equal their reference on every input it accepts; unfit conversations are
rejects with a reason (`rows.check_messages`), not renderer errors (point 5).
Unfinished generation (point 11): `run_render` refuses unless the generate manifest is complete and balanced and
no journal holds rows; `allow_incomplete=True` renders anyway and records it in the shards manifest.

Modules, in reading order:
    renderer.py      the contract every target format implements (`Rendered`: ids + supervised spans)
    kimi_k3/         the Kimi-K3 format (shared/docs/kimi-k3-format.md): tokenizer, message rules, segments,
                     renderer, and the bundled test vocabulary
    hf_template.py   any target with a Hugging Face chat template (the embedded target)
    rows.py          one generation row -> one training sample, or a reject with its reason
    shards.py        atomic shard files and their manifest
    stage.py         the stage: response filters, then rows -> shards, resumable
    originals.py     `--responses original`: the prompts' own answers as generation rows (`originals/`), rendered
                     by the stage into `shards-original/` (`RunDir.with_responses("original")`)
    export.py        `regen export`: shards or conversations to a path or fsspec URI
    show.py          `regen show-render`: one conversation from stdin, rendered and masked
    preflight.py     `check(cfg, rep)`: before a run, the renderer and its tokenizer load

Entry point: `regen.render.stage.run_render(cfg: RenderConfig, run: RunDir)`; `make_renderer(cfg)` is the public
way for other stages to render (eval renders held-out prompts with it); `sample_prompt_side(renderer, messages,
tools, template_kwargs)` counts a row's prompt side before its answer exists (`regen plan`). CLI `regen render`.
Its check before a run: `regen.render.preflight.check(cfg, rep)`.
"""
