"""`--tensor-parallel-size`, `--distributed-backend` and `--distributed-timeout`, for `serve`, `generate` and
`bench offline` (docs/distributed.md)."""

from __future__ import annotations

import argparse

from pagoda.model.ranks import BACKENDS, ParallelOptions


def add_parallel_options(parser: argparse.ArgumentParser) -> None:
    """Add the tensor-parallel options (dests tensor_parallel_size, distributed_backend, distributed_timeout)."""
    g = parser.add_argument_group("tensor parallelism (docs/distributed.md)")
    g.add_argument("--tensor-parallel-size", type=int, default=ParallelOptions.tensor_parallel_size, metavar="N",
                   help="ranks that each hold a shard of the model; on one machine pagoda starts them, under "
                        "torchrun they come from its environment (default 1: one process)")
    g.add_argument("--distributed-backend", default=None, choices=BACKENDS,
                   help="torch.distributed backend (default: gloo on the CPU, nccl on CUDA)")
    g.add_argument("--distributed-timeout", type=float, default=ParallelOptions.timeout_s, metavar="SECONDS",
                   help="how long a collective waits for a rank before the group counts as failed")


def parallel_fields(args: argparse.Namespace) -> dict[str, object]:
    """The EngineOptions fields the options give."""
    return {"tensor_parallel_size": args.tensor_parallel_size, "distributed_backend": args.distributed_backend,
            "distributed_timeout": args.distributed_timeout}
