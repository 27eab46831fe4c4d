"""Target features from a pool of producers through a Mooncake store: the trainer at a large target's scale.

With `train.features: producers` no trainer rank holds the target's decoder: ranks hold only its embeddings,
final norm and LM head (`regen.train.target_head`), and the tap hidden states and last hidden state of every
micro-batch are computed by producers that own the target and arrive through a Mooncake store.

    shards/ -> feed (rank 0's copy) -> dispatcher --lease: token ids--> producer (the target) --put--> store
    trainer rank: feed -> /wait -> store get -> contract check -> loss                 <--/consumed: removed--

Modules, in reading order:
    contract.py    the feature object: layout, header (the contract), the consumer's checks
    store.py       Mooncake: the master on loopback, a store client, the store's own byte figures
    dispatcher.py  rank 0: the plan (the feed's micro-batches), leases, heartbeats, byte budget, failures
    producer.py    a producer process: lease -> target forward -> put -> complete (`regen features produce`)
    client.py      a trainer rank: wait, read, check, hand the loss its features; failures by policy
    pool.py        the trainer's side set up and torn down in one place; the producer/trainer balance report
    netns.py       local pools in a private network namespace (Mooncake clients listen on all interfaces)
    plan.py        `regen plan`'s figures for a pool: bytes per token and row, store and target memory, GPUs
    cli.py         `regen features produce | store | status`

Entry points: `regen.train.loop.run_train` with `train.features: producers`; `regen features ...`.
"""
