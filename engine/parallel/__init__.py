"""Tensor parallelism inside one engine: N ranks, one process each, rank 0 in the engine's
own process. Rank 0 schedules and samples; followers replay its step plans.

* ``shards``: which heads, MLP columns and vocabulary rows each rank owns, and the checks.
* ``group``: the collectives (gloo on CPU, NCCL on CUDA) over a per-engine store.
* ``layers``: vocabulary-parallel embedding and LM head.
* ``step_plan``: the host-side description of one forward, shared by every rank.
* ``block_copy``: KV blocks from an attention group's first rank to the others (a
  replicated latent received once per request).
* ``followers`` (rank 0) / ``follower`` (ranks 1..N-1): process lifecycle and the loop.
"""
