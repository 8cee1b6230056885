"""The model runner: everything that touches tensors in the rollout engine.

It owns the paged KV cache (one (k, v) pair per layer, [num_blocks + 1, block_size, Hkv, Dh]) and turns a
scheduled step (for each sequence: its new tokens, how many of its tokens are already cached, its block table)
into one flat forward of the *shared* model, the same module the trainer updates. Bookkeeping (which blocks,
which tokens) stays in plain Python in block_manager.py and scheduler.py.

Two ways to run a step:

* `forward` (any step: prefill chunks, recompute after preemption, decode): builds an `AttentionBatch` on the
  host and runs the model eagerly.
* `decode` (a step where every sequence brings exactly one new token): fills *static* device buffers, padded to
  a batch-size bucket, and replays the CUDA graph captured for that bucket (mode "graph"), or runs the same
  code eagerly on the same buffers (mode "static": the CPU test of the padding logic). The graph covers the
  model forward; the LM head and the sampler run after it, eagerly, because they take the call's temperature
  and sampling options. The sampler reads the noise-key inputs from the same static buffer.

Why the graph changes no bit: replay runs the kernels the eager forward runs, with the same tile
configurations (no kernel specialises on the number of rows, see exactrl/ops/triton). The bucket's padding rows
are dummy one-token sequences at position 0 that write their K/V into a scratch KV page the block manager never
hands out (`scratch_block`), and rows never mix in any kernel, so a real row cannot see them. Keys past a
sequence's length are masked whatever the table width, and a fully masked key tile is an exact no-op.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from exactrl.model.qwen import CausalLM
from exactrl.ops import BLOCK_N, AttentionBatch


@dataclass
class StepEntry:
    """One sequence's part of a step: `token_ids` are new rows at positions num_cached .. num_cached+len-1."""

    token_ids: list[int]
    num_cached: int
    block_table: list[int]


@dataclass(slots=True)
class DecodeRow:
    """A decode step's sequence: its one new token, where it goes, and its sampling-noise key inputs."""

    token_id: int
    position: int
    block_table: list[int]
    seed: int
    request_id: int
    sample_index: int


def kv_bytes_per_token(model: CausalLM, dtype: torch.dtype | None = None) -> int:
    cfg = model.config
    itemsize = torch.empty((), dtype=dtype or model.dtype).element_size()
    return cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * itemsize


def auto_num_blocks(model: CausalLM, block_size: int, memory_fraction: float, max_tokens_needed: int) -> int:
    """KV blocks from free device memory (CUDA) or a capped budget (CPU), never more than the work needs."""
    per_block = kv_bytes_per_token(model) * block_size
    need = -(-max_tokens_needed // block_size) + 1
    if model.device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(model.device)
        budget = int(free * memory_fraction)
    else:
        budget = int(2 * 1024**3 * memory_fraction)
    return max(2, min(need, budget // per_block))


def graph_buckets(max_batch: int) -> list[int]:
    """Decode batch sizes that get a CUDA graph: 1, 2, 4, 8, then every multiple of 16 up to max_batch."""
    out = [b for b in (1, 2, 4, 8) if b < max_batch] + list(range(16, max_batch + 1, 16))
    if not out or out[-1] < max_batch:
        out.append(max_batch)
    return out


DECODE_MODES = ("eager", "static", "graph")


class ModelRunner:
    def __init__(
        self,
        model: CausalLM,
        num_blocks: int,
        block_size: int,
        *,
        max_num_seqs: int = 256,
        max_model_len: int = 4096,
        decode_mode: str = "eager",
    ):
        if block_size % BLOCK_N:
            raise ValueError(
                f"engine.block_size {block_size} must be a multiple of the attention tile {BLOCK_N}"
            )
        if decode_mode not in DECODE_MODES:
            raise ValueError(f"decode_mode must be one of {DECODE_MODES}, got {decode_mode!r}")
        if decode_mode == "graph" and model.device.type != "cuda":
            raise ValueError("decode_mode 'graph' (CUDA graphs) needs a model on a CUDA device")
        cfg = model.config
        self.model = model
        self.block_size = block_size
        self.num_blocks = num_blocks  # pages the block manager may hand out: 0 .. num_blocks - 1
        self.scratch_block = num_blocks  # one more page: padding rows of a decode bucket write their K/V here
        self.decode_mode = decode_mode
        self.max_num_seqs = max_num_seqs
        self.max_model_len = min(max_model_len, cfg.max_position_embeddings)
        shape = (num_blocks + 1, block_size, cfg.num_kv_heads, cfg.head_dim)
        # Zero-filled: masked keys are multiplied by exactly 0, which needs finite values behind them.
        self.kv_caches = [
            (
                torch.zeros(shape, dtype=model.dtype, device=model.device),
                torch.zeros(shape, dtype=model.dtype, device=model.device),
            )
            for _ in range(cfg.num_layers)
        ]
        self._static: _StaticDecode | None = None
        self.graph_capture_s = 0.0  # capture time of replaced graph sets (see capture_seconds)

    @torch.no_grad()
    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy-on-write: duplicate whole KV blocks src -> dst in every layer."""
        if not pairs:
            return
        dev = self.model.device
        src = torch.tensor([p[0] for p in pairs], device=dev)
        dst = torch.tensor([p[1] for p in pairs], device=dev)
        for k, v in self.kv_caches:
            k.index_copy_(0, dst, k.index_select(0, src))
            v.index_copy_(0, dst, v.index_select(0, src))

    @torch.no_grad()
    def forward(self, entries: list[StepEntry]) -> torch.Tensor:
        """Run one step; return the final hidden state of the last new row of every entry: [len(entries), D]."""
        dev = self.model.device
        ids = torch.tensor([t for e in entries for t in e.token_ids], dtype=torch.int64, device=dev)
        batch = AttentionBatch.paged(
            [e.num_cached for e in entries],
            [len(e.token_ids) for e in entries],
            [e.block_table for e in entries],
            self.block_size,
            device=dev,
        )
        hidden = self.model(ids, batch.q_pos, batch, self.kv_caches)
        return hidden[batch.cu_seqlens_q[1:] - 1]

    # -- decode through static buffers / CUDA graphs -------------------------------------------------------
    def can_decode(self, num_rows: int) -> bool:
        """Whether a pure decode step of num_rows sequences goes through `decode` (else use `forward`)."""
        return self.decode_mode != "eager" and 0 < num_rows <= self.max_num_seqs

    @torch.no_grad()
    def decode(self, rows: list[DecodeRow]) -> tuple[torch.Tensor, torch.Tensor]:
        """One decode step: (hidden [len(rows), D], key parts int64 [4, len(rows)]). hidden is bitwise equal to
        `forward` on the same sequences; key parts are each row's (seed, request_id, sample_index, position of
        the token to sample), the inputs of sampler.noise_key."""
        if not self.can_decode(len(rows)):
            raise ValueError(f"decode takes 1 .. {self.max_num_seqs} rows in mode {self.decode_mode!r}")
        st = self._static_state()
        hidden = st.run(rows)
        return hidden[: len(rows)], st.key_parts[:, : len(rows)]

    @torch.no_grad()
    def decode_sample(self, rows: list[DecodeRow], temperature: float, greedy: bool) -> torch.Tensor:
        """One decode step with the LM head and the fused sampler inside the graph (CUDA, no top-k / top-p):
        float64 [2, len(rows)], each row's (token, logprob at `temperature`), the same numbers as `decode`
        followed by the engine's eager head and sampler."""
        if not self.can_decode(len(rows)) or self.model.device.type != "cuda":
            raise ValueError(f"decode_sample takes 1 .. {self.max_num_seqs} rows of a CUDA model")
        out = self._static_state().run(rows, (float(temperature), bool(greedy)))
        return out[:, : len(rows)]

    def refresh_graphs(self) -> None:
        """Drop the captured graphs if a parameter or the KV cache was reallocated since their capture (graphs
        hold raw addresses; in-place weight updates need nothing). The engine calls this once per `generate`,
        not per step: the weights do not move during a call."""
        st = self._static
        if st is not None and not st.valid(self.model):
            self.graph_capture_s += st.capture_s
            self._static = None  # free the old graphs (and their memory) before capturing new ones

    def _static_state(self) -> _StaticDecode:
        if self._static is None:
            self._static = _StaticDecode(self)
        return self._static

    @property
    def num_graphs(self) -> int:
        return 0 if self._static is None else len(self._static.graphs)

    @property
    def capture_seconds(self) -> float:
        """Time spent capturing CUDA graphs (warm-up runs included), over this runner's life."""
        return self.graph_capture_s + (0.0 if self._static is None else self._static.capture_s)


class _StaticDecode:
    """Static decode buffers and one CUDA graph per batch-size bucket (captured on first use)."""

    def __init__(self, runner: ModelRunner):
        model = runner.model
        self.runner = runner
        self.model = model
        dev = model.device
        self.buckets = graph_buckets(runner.max_num_seqs)
        B = self.buckets[-1]
        bs = runner.block_size
        self.width_blocks = -(-runner.max_model_len // bs)
        width = self.width_blocks * bs
        # Host-side staging (pinned on CUDA) and one device buffer: one copy per step. Sections, each a whole
        # number of 16-element rows so every view is as aligned as a fresh allocation: ids, positions, slot
        # mapping, seed, request id, sample index, key lengths (= the sampled token's position), then the block
        # tables [B, width_blocks]. Sections 3..6 are the sampler's key parts [4, B] with row stride `sec`.
        self.B = B
        self.sec = -(-B // 16) * 16
        self.tw = -(-self.width_blocks // 16) * 16
        n = 7 * self.sec + B * self.tw
        pin = dev.type == "cuda"
        self.host = torch.zeros(n, dtype=torch.int64, pin_memory=pin)
        self.host_np = self.host.numpy()
        self.dev_buf = torch.zeros(n, dtype=torch.int64, device=dev)
        s = self.sec
        view = lambda i: self.dev_buf[i * s : i * s + B]  # noqa: E731
        self.ids, self.pos, self.slots = view(0), view(1), view(2)
        self.seed, self.rid, self.sidx, self.key_lens = view(3), view(4), view(5), view(6)
        self.key_parts = self.dev_buf[3 * s : 7 * s].view(4, s)
        self.tables = self.dev_buf[7 * s :].view(B, self.tw)
        self.cu = torch.arange(B + 1, dtype=torch.int64, device=dev)
        self.q_seq = torch.arange(B, dtype=torch.int64, device=dev)
        self.n = torch.arange(width, dtype=torch.int64, device=dev)
        self.params = _param_ptrs(model)
        self.kv_ptr = runner.kv_caches[0][0].data_ptr()
        self.greedy_mask = torch.ones(B, dtype=torch.bool, device=dev)
        # Graphs per (kind, bucket); kind None: the forward alone, (temperature, greedy): forward + LM head +
        # fused sampler + logprob. All buckets of a kind are captured together, the first time it is needed.
        self.graphs: dict[tuple, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.kinds: set = set()
        self.pool = torch.cuda.graph_pool_handle() if runner.decode_mode == "graph" else None
        self.capture_s = 0.0

    def valid(self, model: CausalLM) -> bool:
        """Graphs hold raw addresses: recapture when a parameter or the KV cache was reallocated."""
        return (
            model is self.model
            and self.kv_ptr == self.runner.kv_caches[0][0].data_ptr()
            and self.params == _param_ptrs(model)
        )

    def _body(self, b: int) -> torch.Tensor:
        """What a decode step of bucket b computes from the static buffers (captured, or run eagerly)."""
        bs = self.runner.block_size
        tables = self.tables[:b, : self.width_blocks]
        n = self.n
        key_lens = self.key_lens[:b]
        key_slots = tables.gather(1, (n // bs)[None, :].expand(b, -1)) * bs + n % bs
        key_slots = torch.where(n[None, :] < key_lens[:, None], key_slots, 0)
        batch = AttentionBatch(
            q_seq=self.q_seq[:b],
            q_pos=self.pos[:b],
            cu_seqlens_q=self.cu[: b + 1],
            key_lens=key_lens,
            key_slots=key_slots,
            max_seqlen_q=1,
            max_key_len=self.runner.max_model_len,
            slot_mapping=self.slots[:b],
            block_size=bs,
        )
        return self.model(self.ids[:b], self.pos[:b], batch, self.runner.kv_caches)

    def _fill(self, rows: list[DecodeRow], b: int) -> None:
        """Write the step's metadata (padded to bucket b with dummy rows) and copy it to the device."""
        h, s, bs, r, tw = self.host_np, self.sec, self.runner.block_size, len(rows), self.tw
        scratch = self.runner.scratch_block
        if r:
            a = np.array(
                [
                    (
                        x.token_id,
                        x.position,
                        x.block_table[x.position // bs],
                        x.seed,
                        x.request_id,
                        x.sample_index,
                    )
                    for x in rows
                ],
                dtype=np.int64,
            )
            h[0:r] = a[:, 0]
            h[s : s + r] = a[:, 1]
            h[2 * s : 2 * s + r] = a[:, 2] * bs + a[:, 1] % bs  # slot of the new token's K/V
            h[3 * s : 3 * s + r] = a[:, 3]
            h[4 * s : 4 * s + r] = a[:, 4]
            h[5 * s : 5 * s + r] = a[:, 5]
            t0 = 7 * s
            for i, x in enumerate(rows):
                h[t0 + i * tw : t0 + i * tw + len(x.block_table)] = x.block_table
        # Dummy rows r..b-1: token 0 at position 0 of a one-token sequence living in the scratch page.
        for k in (0, s, 3 * s, 4 * s, 5 * s):
            h[k + r : k + b] = 0
        h[2 * s + r : 2 * s + b] = scratch * bs
        h[7 * s + r * tw : 7 * s + b * tw : tw] = scratch
        h[6 * s : 6 * s + b] = h[s : s + b] + 1  # key lengths
        n = 7 * s + b * tw
        # Asynchronous copy from pinned memory: the host buffer is rewritten only at the next step, after the
        # engine has read this step's tokens back (a device sync).
        self.dev_buf[:n].copy_(self.host[:n], non_blocking=True)

    def _sample_body(self, b: int, temperature: float, greedy: bool) -> torch.Tensor:
        """The step plus what the engine does after it on the fused-sampler path: LM head, temperature, Gumbel-max
        with the keys from the static buffer, the recorded logprob. -> float64 [2, b]: (token, logprob)."""
        from exactrl.ops.triton.sampling import gumbel_argmax

        ops = self.model.ops
        h, w = self.model.head_inputs(self._body(b))
        raw = ops.linear(h, w)
        # The kernel divides the raw logits by the temperature itself, as ops.scale_logits would (same bits).
        tok = gumbel_argmax(
            raw,
            None,
            self.greedy_mask[:b] if greedy else None,
            key_parts=self.key_parts[:, :b],
            temperature=temperature,
        )
        lp = ops.logprobs_from_logits(raw, tok, temperature)
        return torch.stack((tok.to(torch.float64), lp.to(torch.float64)))

    def _compute(self, kind, b: int) -> torch.Tensor:
        return self._body(b) if kind is None else self._sample_body(b, *kind)

    def run(self, rows: list[DecodeRow], kind=None) -> torch.Tensor:
        """Fill the buffers for `rows` and run the step of `kind` (see __init__): the bucket's output tensor."""
        r = len(rows)
        b = next(x for x in self.buckets if x >= r)
        for row in rows:
            if len(row.block_table) > self.width_blocks or row.position >= self.runner.max_model_len:
                raise ValueError(
                    f"decode row at position {row.position} with {len(row.block_table)} KV blocks is past "
                    f"max_model_len {self.runner.max_model_len}"
                )
        if self.pool is not None and kind not in self.kinds:
            t0 = time.perf_counter()
            self._capture(kind)
            self.capture_s += time.perf_counter() - t0
        self._fill(rows, b)
        entry = self.graphs.get((kind, b))
        if entry is None:
            return self._compute(kind, b)
        entry[0].replay()
        return entry[1]

    def _capture(self, kind) -> None:
        """Capture every bucket of `kind`, largest first, into the shared memory pool. Warm-up runs first
        (Triton compilation, side streams, allocator growth) on all-padding metadata, which writes only into
        the scratch page; so does the capture, which executes nothing."""
        self._fill([], self.B)
        stream = torch.cuda.Stream(self.model.device)
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for b in reversed(self.buckets):
                self._compute(kind, b)
        torch.cuda.current_stream().wait_stream(stream)
        for b in reversed(self.buckets):
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=self.pool):
                out = self._compute(kind, b)
            self.graphs[(kind, b)] = (g, out)
        self.kinds.add(kind)
        torch.cuda.synchronize(self.model.device)


def _param_ptrs(model: CausalLM) -> tuple[int, ...]:
    return tuple(p.data_ptr() for p in model.parameters())
