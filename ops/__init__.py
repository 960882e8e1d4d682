"""The operator layer: what a person runs to start, plan and read runs (the ``specrl`` command,
the one-machine launcher, the embedded Redis, reports and run summaries, the exactly-once ledger
reader, the memory plan). It imports the shared contracts in ``common/`` and starts ``actors/``
and ``learner/`` as processes; neither side imports it (docs/design.md §1.2)."""
