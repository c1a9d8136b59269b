"""One flat tensor of a block: its fetch and all-gather, its gradient shard and early capture,
the parameters that view it (placeholders while unfetched, `p.grad` as a view), a block's flat
tensors fetched and reduced together, this rank's shard as checkpoints read and write it, and
the collectives over flat tensors. The modules, in import order: docs/architecture.md ("The
runtime's modules")."""
