"""The model runner: everything that touches tensors in the rollout engine.

It owns the paged KV cache (one (k, v) pair per layer, [num_blocks + 1, block_size, Hkv, Dh]) and turns a
scheduled step (for each sequence: its new tokens, how many of its tokens are already cached, its block table)
into one flat forward of the *shared* model, the same module the trainer updates. Bookkeeping (which blocks,
which tokens) stays in plain Python in block_manager.py and scheduler.py.

Two ways to run a step:

* `forward` (any step: prefill chunks, recompute after preemption, decode): builds an `AttentionBatch` on the
  host and runs the model eagerly.
* `decode` / `decode_sample` (a step where every sequence brings exactly one new token): fills *static* device
  buffers, padded to a batch-size bucket, and replays the CUDA graph captured for that bucket (mode "graph"),
  or runs the same code eagerly on the same buffers (mode "static": the CPU test of the padding logic).
  `decode` graphs cover the model forward, and the engine's LM head and torch sampler run after them (top-k /
  top-p); `decode_sample` graphs (one set per temperature and greedy flag) also hold the LM head, the fused
  sampler and the recorded logprob. The sampler reads the noise-key inputs from the same static buffer.

`fetch` queues a step's (token, logprob) rows for the host behind the step and returns at once, so the engine
can schedule and launch the next `decode_sample` step before it reads them: that step takes the still-pending
tokens from the previous one's output on the device (`DecodeRow.prev_row`, `last_tokens`).

Why the graph changes no bit: replay runs the kernels the eager forward runs, with the same tile
configurations (no kernel specialises on the number of rows, see exactrl/ops/triton). The bucket's padding rows
are dummy one-token sequences at position 0 that write their K/V into a scratch KV page the block manager never
hands out (`scratch_block`), and rows never mix in any kernel, so a real row cannot see them. Keys past a
sequence's length are masked whatever the table width, and a fully masked key tile is an exact no-op.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from exactrl.engine.sampler import noise_keys, sample
from exactrl.model.moe import static_decode_step
from exactrl.model.qwen import CausalLM
from exactrl.ops import BLOCK_N, AttentionBatch
from exactrl.ops.batch import upload_int64
from exactrl.progress import Progress


@dataclass
class StepEntry:
    """One sequence's part of a step: `token_ids` are new rows at positions num_cached .. num_cached+len-1."""

    token_ids: list[int]
    num_cached: int
    block_table: list[int]


@dataclass(slots=True)
class DecodeRow:
    """A decode step's sequence: its one new token, where it goes, and its sampling-noise key inputs.

    prev_row >= 0: the token is still on the device (the engine has not read the previous step back yet): it
    is row prev_row of the previous `decode_sample` output, and token_id is ignored."""

    token_id: int
    position: int
    block_table: list[int]
    seed: int
    request_id: int
    sample_index: int
    prev_row: int = -1


class StepOutput:
    """A step's sampled rows, (token, logprob) as float64 [2, rows], on their way to the host: `result()`
    waits for them. The copy is queued behind the step, so the host can schedule and launch the next step
    first."""

    def __init__(self, host: torch.Tensor, event: torch.cuda.Event | None):
        self._host = host
        self._event = event

    def result(self) -> tuple[list[int], list[float]]:
        if self._event is not None:
            self._event.synchronize()
        tok, lp = self._host.tolist()
        return [int(t) for t in tok], lp


def kv_bytes_per_token(model: CausalLM, dtype: torch.dtype | None = None) -> int:
    cfg = model.config
    itemsize = torch.empty((), dtype=dtype or model.dtype).element_size()
    return cfg.num_layers * 2 * model.kv_heads * cfg.head_dim * itemsize


def auto_num_blocks(
    model: CausalLM, block_size: int, memory_fraction: float, max_tokens_needed: int, extra_free: int = 0
) -> int:
    """KV blocks from free device memory (CUDA) or a capped budget (CPU), never more than the work needs.
    extra_free: bytes held now that would be free for the cache (the cache it would replace)."""
    per_block = kv_bytes_per_token(model) * block_size
    need = -(-max_tokens_needed // block_size) + 1
    if model.device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(model.device)
        budget = int((free + extra_free) * memory_fraction)
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
        self.decode_rows = max_num_seqs  # the current call's most rows at once (`refresh_graphs`)
        self.max_model_len = min(max_model_len, cfg.max_position_embeddings)
        self.kv_device, self.kv_dtype = model.device, model.dtype
        self.kv_shape = (num_blocks + 1, block_size, model.kv_heads, cfg.head_dim)
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._kv_flat: torch.Tensor | None = None
        # Memory phases (exactrl/train/phases.py): the cache is freed while the trainer runs and allocated again
        # before the next generation. Counted here, read by the RL loop as perf metrics.
        self.kv_allocations = 0
        self.kv_allocate_s = 0.0  # wall time of the allocations after the first (zero-fill included)
        self.graphs_dropped = 0  # decode graphs dropped because the KV cache or a weight moved
        self._static: _StaticDecode | None = None
        self.graph_capture_s = 0.0  # capture time of replaced graph sets (see capture_seconds)
        self.allocate_kv()
        # Pinned host buffers for StepOutput, used in turn: the engine resolves a step before it fetches the
        # step after next, so two suffice (each one's last copy is waited for before it is reused anyway).
        self._out_host: list[tuple[torch.Tensor, torch.cuda.Event | None]] = [
            (torch.empty(0, dtype=torch.float64), None)
        ] * 2
        self._out_turn = 0

    # -- the KV cache: allocated, released between phases, allocated again ---------------------------------
    @property
    def kv_released(self) -> bool:
        return self._kv_flat is None

    @property
    def kv_cache_bytes(self) -> int:
        """Device bytes of the cache (K and V of every layer, the scratch page included) while allocated."""
        return 0 if self._kv_flat is None else self._kv_flat.numel() * self._kv_flat.element_size()

    def allocate_kv(self) -> None:
        """Allocate the cache (no-op while allocated). One flat buffer, every layer's K and V a view of it: one
        device allocation, so a cache allocated again after `release_kv` either lands at its old address (the
        captured decode graphs stay valid) or moves as a whole (they are dropped and captured again, see
        `refresh_graphs`); never half of it. Zero-filled: masked keys are multiplied by exactly 0, which needs
        finite values behind them (and a cache allocated again holds nothing of a previous call: every call
        starts with a fresh block manager)."""
        if self._kv_flat is not None:
            return
        t0 = time.perf_counter()
        layers = self.model.config.num_layers
        per = math.prod(self.kv_shape)
        if self.kv_device.type == "cuda" and self.kv_allocations:
            # The blocks the training phase cached go back to the device first, so that the one large
            # allocation finds room (and, with luck, the address it had).
            torch.cuda.empty_cache()
        flat = torch.zeros(2 * layers * per, dtype=self.kv_dtype, device=self.kv_device)
        self._kv_flat = flat
        self.kv_caches = [
            (
                flat[(2 * i) * per : (2 * i + 1) * per].view(self.kv_shape),
                flat[(2 * i + 1) * per : (2 * i + 2) * per].view(self.kv_shape),
            )
            for i in range(layers)
        ]
        if self.kv_allocations:
            if self.kv_device.type == "cuda":
                torch.cuda.synchronize(self.kv_device)  # the zero-fill's time, not only its launch
            self.kv_allocate_s += time.perf_counter() - t0
        self.kv_allocations += 1

    def release_kv(self) -> int:
        """Free the cache's device memory (between generations: the training phase needs it); returns the bytes
        freed. The decode graphs are kept: they are replayed only after `allocate_kv`, and `refresh_graphs`
        drops them if the cache came back elsewhere."""
        n = self.kv_cache_bytes
        self.kv_caches = []
        self._kv_flat = None
        if n and self.kv_device.type == "cuda":
            torch.cuda.empty_cache()
        return n

    def fetch(self, out: torch.Tensor) -> StepOutput:
        """Start copying a step's output (float64 [2, rows] on the model's device) to the host."""
        if out.device.type != "cuda":
            return StepOutput(out.clone(), None)
        rows = out.shape[1]
        i = self._out_turn
        self._out_turn ^= 1
        host, event = self._out_host[i]
        if event is not None:
            event.synchronize()
        if host.numel() < 2 * rows:
            host = torch.empty(2 * max(rows, self.max_num_seqs), dtype=torch.float64, pin_memory=True)
        # A contiguous destination: a strided one would make PyTorch copy through a pageable temporary, which
        # waits for the step.
        dst = host[: 2 * rows].view(2, rows)
        dst.copy_(out, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        self._out_host[i] = (host, event)
        return StepOutput(dst, event)

    @torch.no_grad()
    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy-on-write: duplicate whole KV blocks src -> dst in every layer."""
        if not pairs:
            return
        src, dst = upload_int64([np.array(pairs, dtype=np.int64).T.copy()], self.model.device)[0]
        for k, v in self.kv_caches:
            k.index_copy_(0, dst, k.index_select(0, src))
            v.index_copy_(0, dst, v.index_select(0, src))

    @torch.no_grad()
    def forward(self, entries: list[StepEntry]) -> torch.Tensor:
        """Run one step; return the final hidden state of the last new row of every entry: [len(entries), D]."""
        dev = self.model.device
        (ids,) = upload_int64([np.array([t for e in entries for t in e.token_ids], dtype=np.int64)], dev)
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
        """One decode step with the LM head and the sampler (no top-k / top-p) inside the graph: float64
        [2, len(rows)], each row's (token, logprob at `temperature`), the same numbers as `decode` followed by
        the engine's eager head and sampler. A row's token may be a row of the previous decode_sample call's
        output, still on the device (DecodeRow.prev_row)."""
        if not self.can_decode(len(rows)):
            raise ValueError(
                f"decode_sample takes 1 .. {self.max_num_seqs} rows in mode {self.decode_mode!r}"
            )
        out = self._static_state().run(rows, (float(temperature), bool(greedy)))
        return out[:, : len(rows)]

    def refresh_graphs(self, max_rows: int | None = None, agree: Callable[[int], int] | None = None) -> None:
        """Drop the captured graphs if a parameter or the KV cache was reallocated since their capture (graphs
        hold raw addresses; in-place weight updates need nothing). The engine calls this once per `generate`,
        not per step: the weights do not move during a call. max_rows: the most sequences the call decodes at
        once (None: max_num_seqs); graphs are captured for the batch-size buckets up to it, a later call's larger
        buckets when it needs them (a run whose cache moves every step captures what its calls use, not all
        max_num_seqs' buckets: 13 s of a qwen3-30b-a3b RL step's 17 s of generation for 36 buckets, 2 x H200).
        agree: a split engine's group minimum (`RolloutEngine.agree_blocks`): the graphs are kept only where every
        rank's are valid, so that no rank captures (its warm-up runs collectives) while another replays."""
        self.decode_rows = self.max_num_seqs if max_rows is None else max(1, min(max_rows, self.max_num_seqs))
        if self.kv_released:
            raise RuntimeError("the engine's KV cache is released: allocate_kv() before generating")
        st = self._static
        ok = st is not None and st.valid(self.model)
        if agree is not None:
            ok = bool(agree(int(ok)))
        if st is not None and not ok:
            self.graph_capture_s += st.capture_s
            self.graphs_dropped += len(st.graphs)
            self._static = None  # free the old graphs (and their memory) before capturing new ones

    def release_graphs(self) -> None:
        """Reset and drop the captured decode graphs (the next decode captures them again). A split engine's graphs
        hold NCCL collectives, and they must be gone before their process group is destroyed:
        `destroy_process_group` waits in ncclCommDestroy for ever otherwise (PyTorch issue 115388; seen with
        benchmarks/decode_split.py at T = 2 on 2 x H200, 2026-11-28). The runner and its graph state refer to each
        other, so dropping the engine alone leaves them for the cycle collector, after the group may be gone."""
        st = self._static
        if st is None:
            return
        self.graph_capture_s += st.capture_s
        st.drop_graphs()
        self._static = None

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
        # mapping, seed, request id, sample index, key lengths (= the sampled token's position), previous-output
        # rows (DecodeRow.prev_row), then the block tables [B, width_blocks]. Sections 3..6 are the sampler's
        # key parts [4, B] with row stride `sec`.
        self.B = B
        self.sec = -(-B // 16) * 16
        self.tw = -(-self.width_blocks // 16) * 16
        n = 8 * self.sec + B * self.tw
        pin = dev.type == "cuda"
        # Two staging buffers used in turn: the engine fills step t+1 while step t (and its copy) may still be
        # queued; each one's last copy is waited for before it is rewritten.
        self.staging = [torch.zeros(n, dtype=torch.int64, pin_memory=pin) for _ in range(2)]
        self.staged: list[torch.cuda.Event | None] = [None, None]
        self.turn = 0
        self.dev_buf = torch.zeros(n, dtype=torch.int64, device=dev)
        s = self.sec
        view = lambda i: self.dev_buf[i * s : i * s + B]  # noqa: E731
        self.ids, self.pos, self.slots = view(0), view(1), view(2)
        self.seed, self.rid, self.sidx, self.key_lens = view(3), view(4), view(5), view(6)
        self.prev_row = view(7)
        self.key_parts = self.dev_buf[3 * s : 7 * s].view(4, s)
        self.tables = self.dev_buf[8 * s :].view(B, self.tw)
        # The tokens of the last decode_sample step, where the next step's pending rows take theirs from.
        self.last_tokens = torch.zeros(B, dtype=torch.int64, device=dev)
        self.cu = torch.arange(B + 1, dtype=torch.int64, device=dev)
        self.q_seq = torch.arange(B, dtype=torch.int64, device=dev)
        self.n = torch.arange(width, dtype=torch.int64, device=dev)
        self.params = _param_ptrs(model)
        # The flat buffer's start: every layer's K/V moves with it.
        self.kv_ptr = runner.kv_caches[0][0].data_ptr()
        self.greedy_mask = torch.ones(B, dtype=torch.bool, device=dev)
        # Graphs per (kind, bucket); kind None: the forward alone, (temperature, greedy): forward + LM head +
        # fused sampler + logprob. The buckets of a kind up to the call's rows (`ModelRunner.refresh_graphs`) are
        # captured together, the first time a step needs one of them; `captured`: the largest so far, per kind.
        self.graphs: dict[tuple, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.captured: dict = {}
        self.high = 0  # the largest bucket captured into the pool
        self.pool = torch.cuda.graph_pool_handle() if runner.decode_mode == "graph" else None
        self.capture_s = 0.0

    def valid(self, model: CausalLM) -> bool:
        """Graphs hold raw addresses: recapture when a parameter or the KV cache was reallocated."""
        return (
            model is self.model
            and self.kv_ptr == self.runner.kv_caches[0][0].data_ptr()
            and self.params == _param_ptrs(model)
        )

    def _body(self, b: int, ids: torch.Tensor | None = None) -> torch.Tensor:
        """What a decode step of bucket b computes from the static buffers (captured, or run eagerly); ids: the
        input tokens when not self.ids[:b]."""
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
        with static_decode_step():  # experts split over ranks compute every slot here (no host sync)
            return self.model(
                self.ids[:b] if ids is None else ids, self.pos[:b], batch, self.runner.kv_caches
            )

    def _fill(self, rows: list[DecodeRow], b: int) -> None:
        """Write the step's metadata (padded to bucket b with dummy rows) and copy it to the device."""
        turn = self.turn
        self.turn ^= 1
        staged = self.staged[turn]
        if staged is not None:
            staged.synchronize()
        host = self.staging[turn]
        h, s, bs, r, tw = host.numpy(), self.sec, self.runner.block_size, len(rows), self.tw
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
                        x.prev_row,
                    )
                    for x in rows
                ],
                dtype=np.int64,
            )
            if ((a[:, 0] < 0) & (a[:, 6] < 0)).any():
                raise RuntimeError("a decode row's token is still pending but names no previous output row")
            h[0:r] = a[:, 0]
            h[s : s + r] = a[:, 1]
            h[2 * s : 2 * s + r] = a[:, 2] * bs + a[:, 1] % bs  # slot of the new token's K/V
            h[3 * s : 3 * s + r] = a[:, 3]
            h[4 * s : 4 * s + r] = a[:, 4]
            h[5 * s : 5 * s + r] = a[:, 5]
            h[7 * s : 7 * s + r] = a[:, 6]
            t0 = 8 * s
            for i, x in enumerate(rows):
                h[t0 + i * tw : t0 + i * tw + len(x.block_table)] = x.block_table
        # Dummy rows r..b-1: token 0 at position 0 of a one-token sequence living in the scratch page.
        for k in (0, s, 3 * s, 4 * s, 5 * s):
            h[k + r : k + b] = 0
        h[7 * s + r : 7 * s + b] = -1
        h[2 * s + r : 2 * s + b] = scratch * bs
        h[8 * s + r * tw : 8 * s + b * tw : tw] = scratch
        h[6 * s : 6 * s + b] = h[s : s + b] + 1  # key lengths
        n = 8 * s + b * tw
        # Asynchronous copy from pinned memory, queued behind the previous step; the event marks when this
        # staging buffer may be rewritten.
        self.dev_buf[:n].copy_(host[:n], non_blocking=True)
        if host.is_pinned():
            event = torch.cuda.Event()
            event.record()
            self.staged[turn] = event

    def _sample_body(self, b: int, temperature: float, greedy: bool) -> torch.Tensor:
        """The step plus what the engine does after it on the fused-sampler path: LM head, temperature, Gumbel-max
        with the keys from the static buffer, the recorded logprob. -> float64 [2, b]: (token, logprob). Rows
        with prev_row >= 0 take their input token from the previous such step's tokens (`last_tokens`)."""
        ops = self.model.ops
        prev = self.prev_row[:b]
        ids = torch.where(prev >= 0, self.last_tokens.index_select(0, prev.clamp(min=0)), self.ids[:b])
        raw = self.model.head_logits(self._body(b, ids))
        g = self.greedy_mask[:b] if greedy else None
        if raw.is_cuda:
            from exactrl.ops.triton.sampling import gumbel_argmax

            # The kernel divides the raw logits by the temperature itself, as ops.scale_logits would (same bits).
            tok = gumbel_argmax(raw, None, g, key_parts=self.key_parts[:, :b], temperature=temperature)
        else:  # the static mode's CPU run: the torch sampler the engine's eager path uses
            kp = self.key_parts[:, :b]
            tok = sample(ops.scale_logits(raw, temperature), noise_keys(kp[0], kp[1], kp[2], kp[3]), greedy=g)
        self.last_tokens[:b].copy_(tok)
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
        # The capture's warm-up rewrites last_tokens: not while a step's tokens are pending (a call that decodes more
        # rows than it said runs this step without a graph: the same computation, launched by the host).
        if self.pool is not None and self.captured.get(kind, 0) < b and all(row.prev_row < 0 for row in rows):
            upto = max(b, next(x for x in self.buckets if x >= self.runner.decode_rows))
            if upto > self.high and self.graphs:
                # Larger than anything captured into the pool: a capture now would add its working set to the
                # pool's; instead every graph goes and the pool starts again, captured largest first (other kinds
                # are captured again when next needed, up to the new high mark): one working set, as planned.
                self.drop_graphs()
                self.pool = torch.cuda.graph_pool_handle()
            # Up to the pool's high mark: the smaller buckets reuse the blocks of the largest.
            upto = max(upto, self.high)
            t0 = time.perf_counter()
            self._capture(kind, upto)
            self.capture_s += time.perf_counter() - t0
        self._fill(rows, b)
        entry = self.graphs.get((kind, b))
        if entry is None:
            return self._compute(kind, b)
        entry[0].replay()
        return entry[1]

    def drop_graphs(self) -> None:
        """Reset and forget every captured graph (their pool's memory goes with the last of them)."""
        for graph, _ in self.graphs.values():
            graph.reset()
        self.graphs, self.captured = {}, {}

    def _capture(self, kind, upto: int) -> None:
        """Capture the buckets of `kind` not captured yet up to bucket `upto`, largest first, into the shared
        memory pool. Warm-up runs first (Triton compilation, side streams, allocator growth) on all-padding
        metadata, which writes only into the scratch page; so does the capture, which executes nothing."""
        self._fill([], self.B)
        todo = [b for b in self.buckets if self.captured.get(kind, 0) < b <= upto]
        n = len(todo)
        what = "decode" if kind is None else "sampling decode"
        # The first warm-up compiles the Triton kernels: with the captures, seconds to minutes for a large model.
        with Progress(f"capturing {what} CUDA graphs ({n} batch sizes up to {upto})", 2 * n, "steps") as bar:
            stream = torch.cuda.Stream(self.model.device)
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for b in reversed(todo):
                    self._compute(kind, b)
                    bar.update(1)
            torch.cuda.current_stream().wait_stream(stream)
            for b in reversed(todo):
                g = torch.cuda.CUDAGraph()
                # thread_local: with algorithm.overlap = "tail" the trainer's thread may launch (and allocate)
                # while this engine thread captures; only this thread's own calls must stay capture-safe.
                with torch.cuda.graph(g, pool=self.pool, capture_error_mode="thread_local"):
                    out = self._compute(kind, b)
                self.graphs[(kind, b)] = (g, out)
                bar.update(1)
            self.captured[kind] = upto
            self.high = max(self.high, upto)
            torch.cuda.synchronize(self.model.device)


def _param_ptrs(model: CausalLM) -> tuple[int, ...]:
    return tuple(p.data_ptr() for p in model.parameters())
