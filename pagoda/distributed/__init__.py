"""Past one process: tensor parallelism on torch.distributed (gloo on CPU ranks, NCCL on GPUs).

Design note. A group of N ranks holds one model, each rank a shard of every layer
(pagoda/model/shard.py says which rows and columns), and runs the same forward on
its shard. Rank 0 alone owns the scheduler, the block ledger and sampling: the
engine is the single-process engine, its runner a `TensorParallelRunner`
(pagoda/model/runner.py) that sends every rank the step's plan (its chunks' token
ids, lengths and block tables) in one broadcast before running the step itself.
The other ranks only compute (`pagoda.model.ranks.run_worker`): they
receive a plan, run it on their shard of the weights and of the KV cache (split by
whole key/value heads), and take part in the step's collectives.

This room holds only the group and its collectives (`group.py`), with their cost
counted; it knows nothing of the model. Starting the ranks (spawned by pagoda on one
machine, or by torchrun across machines) and the worker ranks' loop are assembly, beside
the engine's: pagoda/model/ranks.py. docs/distributed.md has the command lines.
"""
