"""A fake model runner that still has to get the paged KV cache right.

It stores each computed token id in a slot of a flat "KV cache" through the
request's block table, and its logits for a sampling row are a deterministic
function of the context it reads back through that same table (the last
token and a checksum of the whole context). A request's distribution thus
depends only on its own tokens, as with a real model, and any ledger mistake
(a block handed to two requests, a stale table after preemption, a slot never
written) changes what the request reads and shows up as a mismatch against
its solo run, or as a read of a never-written slot, which raises.

Like the CPU matmuls it pads a step's rows to a multiple of 4 (`row_multiple`),
so greedy requests get n-gram drafts (core/speculative.py) in the padded rows:
a draft's row reads the context through the draft itself, so a rejected
draft's slot that is not rewritten before it is read changes the request.

LoRA adapters. `load_adapter` loads one by name (`prepare_adapter`, then
`install_adapter`, as the torch runner's; its bytes are a number made of its
name) and gives it a salt, a hash of its name and path: the same adapter answers
the same in every run, and a name loaded again from another path answers as other
weights would. A row of a chunk whose request names an adapter adds its salt to the context key,
so each adapter answers unlike the base and unlike every other (but for a clash
of two hashes: about 1 in 65,000 at 256 table rows); each slot also keeps the salt it was written under,
and a row that reads a slot another adapter wrote (KV computed under the wrong
weights: a prefix shared across adapters) reads it into its key. A row computed
with another adapter's deltas, or on another adapter's KV, so changes its
request's tokens and fails the solo comparison. A chunk naming an adapter that
is not loaded raises, as the real runner would have nothing to add.

Its vocabulary may be as wide as a real model's (a crowd recorded from real
traffic holds real token ids): the table keeps at most `TABLE_ROWS` rows, and a
context is keyed into one of them (the last token and the checksum, modulo the
rows), so a 128k vocabulary costs 128k columns, not 128k squared. Up to
`TABLE_ROWS` tokens the table is square and the key the plain token id.
"""

from __future__ import annotations

import zlib
from functools import lru_cache

import torch

from pagoda.core.adapters import AdapterError, AdapterInfo, PreparedAdapter
from pagoda.core.batch import SchedulerOutput
from pagoda.core.batch import RunnerOutput

EOS_TOKEN_ID = 0
TABLE_ROWS = 256  # the most rows of the logit table, whatever the vocabulary
ADAPTER_RANK = 8  # a fake adapter's rank (or the engine's max_lora_rank, when that is lower)
ADAPTER_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")


class FakeModelRunner:
    def __init__(self, num_blocks: int, block_size: int, vocab_size: int = 256, seed: int = 0, eos_bias: float = 2.0,
                 row_multiple: int = 4):
        self.vocab_size = vocab_size
        self.row_multiple = row_multiple
        self.block_size = block_size
        self.cache = [-1] * (num_blocks * block_size)  # the token id stored in each slot
        self.num_table_rows = min(vocab_size, TABLE_ROWS)
        self.table = _logit_table(vocab_size, seed, eos_bias)  # [context key, vocab], read only
        self.table_rows = _table_rows(vocab_size, seed, eos_bias)  # its rows [1, vocab]: a list index, no tensor op
        # LoRA adapters: name -> (key salt, last-token salt), and each slot's salt as it was written (0: the base);
        # kept only once an adapter is loaded, so a run without adapters pays nothing
        self.adapters: dict[str, tuple[int, int]] = {}
        self.infos: dict[str, AdapterInfo] = {}
        self.tags: list[int] | None = None
        # what the steps mixed: steps with an adapter's rows, steps with rows of two or more of (base, adapters...),
        # and the most distinct adapters (the base not counted) one step ran
        self.adapter_steps = 0
        self.mixed_adapter_steps = 0
        self.peak_step_adapters = 0

    # -- LoRA adapters -----------------------------------------------------
    def load_adapter(self, name: str, path: str, max_rank: int) -> AdapterInfo:
        """Load a fake adapter: its salts are hashes of its name and path, so its answers are the same in every run."""
        return self.install_adapter(self.prepare_adapter(name, path, max_rank))

    def prepare_adapter(self, name: str, path: str, max_rank: int) -> PreparedAdapter:
        """A fake adapter's salts and info (touches nothing of the runner's: any thread may call it)."""
        rows, made = self.num_table_rows, f"{name}\0{path}".encode()
        key_salt = 1 + zlib.crc32(made) % max(rows - 1, 1)  # never 0 mod rows: never the base's key
        salts = (key_salt, zlib.crc32(made + b"#last") % rows)
        rank = min(ADAPTER_RANK, max_rank)
        info = AdapterInfo(name, str(path), rank, (1 + zlib.crc32(name.encode()) % 7) * rank * 4096, ADAPTER_TARGETS)
        return PreparedAdapter(info, max_rank, salts)

    def install_adapter(self, prepared: PreparedAdapter) -> AdapterInfo:
        """Serve a prepared fake adapter: chunks may name it from now on."""
        name = prepared.info.name
        if name in self.adapters:
            raise AdapterError(f"LoRA adapter {name!r} is already loaded", "lora_name")
        self.adapters[name] = prepared.weights
        if self.tags is None:
            self.tags = [0] * len(self.cache)
        self.infos[name] = prepared.info
        return prepared.info

    def unload_adapter(self, name: str) -> None:
        del self.adapters[name]
        del self.infos[name]

    def chunk_adapters(self, batch: SchedulerOutput) -> list[str | None]:
        """Each chunk's adapter, in the batch's order (the torch runner's StepPlan.adapters)."""
        return [chunk.request.adapter for chunk in batch.chunks]

    def _salts(self, batch: SchedulerOutput) -> dict[int, tuple[int, int]]:
        """The salts of each chunk (by its id) from its adapter; counts what the step mixed."""
        names = self.chunk_adapters(batch)
        salts = {}
        for chunk, name in zip(batch.chunks, names):
            if name is not None and name not in self.adapters:
                raise RuntimeError(f"request {chunk.request.request_id} names LoRA adapter {name!r}, "
                                   "which is not loaded")
            salts[id(chunk)] = (0, 0) if name is None else self.adapters[name]
        distinct = set(names)
        adapters = len(distinct - {None})
        self.adapter_steps += adapters > 0
        self.mixed_adapter_steps += len(distinct) > 1
        self.peak_step_adapters = max(self.peak_step_adapters, adapters)
        return salts

    def _tag(self, block_table: tuple[int, ...], start: int, n: int, salt: int) -> None:
        """Record the salt the slots of positions start..start+n were written under."""
        bs, tags, pos, end = self.block_size, self.tags, start, start + n
        assert tags is not None
        while pos < end:
            offset = pos % bs
            m = min(bs - offset, end - pos)
            base = block_table[pos // bs] * bs + offset
            tags[base : base + m] = [salt] * m
            pos += m

    def _tag_sum(self, block_table: tuple[int, ...], end: int) -> int:
        """The salts of positions [0, end), summed."""
        bs, tags = self.block_size, self.tags
        assert tags is not None
        return sum(sum(tags[block_table[i] * bs : block_table[i] * bs + min(bs, end - i * bs)])
                   for i in range(-(-end // bs)))

    def _write(self, block_table: tuple[int, ...], start: int, token_ids: list[int]) -> None:
        """Store tokens at positions start.. through the table, one block-sized slice at a time."""
        bs, cache, pos, done = self.block_size, self.cache, start, 0
        while done < len(token_ids):
            offset = pos % bs
            n = min(bs - offset, len(token_ids) - done)
            base = block_table[pos // bs] * bs + offset
            cache[base : base + n] = token_ids[done : done + n]
            pos, done = pos + n, done + n

    def _read(self, block_table: tuple[int, ...], end: int) -> list[int]:
        """The stored tokens of positions [0, end), gathered through the table block by block."""
        bs, cache = self.block_size, self.cache
        context: list[int] = []
        for i in range(-(-end // bs)):
            base = block_table[i] * bs
            context += cache[base : base + min(bs, end - i * bs)]
        return context

    def execute(self, batch: SchedulerOutput) -> RunnerOutput:
        """Write each chunk's tokens into its slots, then read each logits row's whole context back."""
        salts = self._salts(batch) if self.tags is not None else None
        for chunk in batch.chunks:
            token_ids = chunk.token_ids
            self._write(chunk.block_table, chunk.start, token_ids)
            if salts is not None:
                self._tag(chunk.block_table, chunk.start, len(token_ids), salts[id(chunk)][0])
        last, key, rows = [], [], self.num_table_rows
        for chunk in batch.logits_chunks:
            last_row = chunk.start + chunk.num_rows  # its logits rows are its last: prompt rows, last token, drafts
            for end in range(last_row - chunk.num_logits_rows + 1, last_row + 1):
                context = self._read(chunk.block_table, end)
                if min(context) < 0:
                    raise RuntimeError(f"request {chunk.request.request_id} read a KV slot that was never written")
                if salts is None:
                    last.append(context[-1] % rows)
                    key.append((sum(context) * 31 + end) % rows)
                    continue
                key_salt, last_salt = salts[id(chunk)]
                # 0 when every slot read was written under this row's adapter; else never 0 mod rows
                drift = self._tag_sum(chunk.block_table, end) - key_salt * end
                last.append((context[-1] + last_salt) % rows)
                key.append((sum(context) * 31 + end + key_salt + (drift and 1 + drift % max(rows - 1, 1))) % rows)
        if not last:
            return RunnerOutput(logits=torch.empty(0, self.vocab_size))
        # logits [rows, vocab] = table[last] + table[key]; the cheapest gather for each batch shape
        # (this is most of a simulated step), the same float additions either way
        if len(last) == 1:
            return RunnerOutput(logits=self.table_rows[last[0]] + self.table_rows[key[0]])
        rows = torch.index_select(self.table, 0, torch.tensor(last + key))
        return RunnerOutput(logits=rows[: len(last)] + rows[len(last) :])


@lru_cache(maxsize=8)
def _table_rows(vocab_size: int, seed: int, eos_bias: float) -> tuple[torch.Tensor, ...]:
    """The table's rows as [1, vocab] views, split once for every run that shares the table."""
    return _logit_table(vocab_size, seed, eos_bias).split(1)


@lru_cache(maxsize=8)
def _logit_table(vocab_size: int, seed: int, eos_bias: float) -> torch.Tensor:
    """The fake model's "weights": a fixed random table (shared by every run with the same seed)."""
    g = torch.Generator().manual_seed(seed)
    table = torch.randn(min(vocab_size, TABLE_ROWS), vocab_size, generator=g) * 2.5
    table[:, EOS_TOKEN_ID] += eos_bias - 2.0  # EOS likely enough that some requests stop early
    return table
