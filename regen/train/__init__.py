"""Stage 4, train: `shards/` + the target model -> a DSpark draft (`train/checkpoints/step-*/`) and its acc_len.

In:  token shards (read through `schemas.shard` and their manifest's contract), the target from a local path.
Out: servable draft checkpoints (`config.json` + `model.safetensors`) with resumable state; `eval.json`.

Modules, in reading order:
    draft_config.py  `DSparkConfig`: every field serving reads (spec §8) and the training knobs (§5)
    layers.py        norms, YaRN RoPE, MLA / GQA block attention, Markov and confidence heads
    model.py         `DSparkDraft`: tap context path, block backbone, heads; save / load
    loss.py          anchors, block mask, decay weights, CE + L1 + confidence (spec §5)
    fused_loss.py    the vocabulary-wide terms in one chunked pass
    target.py        the target's tap hidden states, computed on the fly
    feed.py          shards -> micro-batches, per rank, checksummed, resumable, `--follow`
    draft_vocab.py   the reduced draft vocabulary (EAGLE-3 d2t / t2d)
    parallel.py      process group and FSDP2, applied in one function
    checkpoint.py    servable draft + exact resume state
    step.py          one optimizer step: the objective, a micro-batch prepared on the host, the step
    trainer.py       `Trainer`: state declared, each component from its sub-config, `build` then `train`
    loop.py          `regen train`: the command line, the process group, then the trainer
    warm_start.py    `train.init_from`: an existing draft (regen's or an engine's folder), checked, loaded
    tracking.py      figures to TensorBoard (W&B, MLflow where asked), the run's configuration, progress lines
    periodic_eval.py the held-out estimate every N steps, the best checkpoint, the loop's hooks
    eval.py          acc_len against the target on held-out prompts (spec §7), greedy and at --temperature
    eval_cli.py      `regen eval`'s flags, summary and tables
    eval_cells.py    acc_len per category x length band x mode, per round and per request, per position
    sampling.py      speculative rejection sampling: temperature / top-p, residual, the verification rule
    verification.py  the served protocols: probabilistic / greedy drafting x token-level / block verification
    preflight.py     `check(cfg, rep)`: before a run, the target, the draft it builds, features, warm start, tracking

Entry points: `regen.train.loop.run_train(cfg: TrainConfig, run: RunDir)`, `regen.train.eval.run_eval(...)`;
CLI `regen train`, `regen eval`; `python -m regen.train` / `torchrun ... -m regen.train -- ...`.
Its check before a run: `regen.train.preflight.check(cfg, rep)` (returns the draft config it will train).
"""
