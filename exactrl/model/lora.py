"""LoRA adapters on the decoder's projections, computed with the same invariant ops on both paths.

A targeted projection computes `y = x W^T + s * ((x A^T) B^T)`, always in this order: the base product, the
low-rank product (two `ops.linear` calls), the scale, the add. The rollout engine and the trainer run the very
same module, so a sampled token's logprob keeps its bits on both sides. The adapter is not merged into W: in
floating point `x (W + s B A)^T` is not `x W^T + s (x A^T) B^T` (tests/lora measure the difference), and the
trainer computes the unmerged form, so the engine must too.

- Packed projections (q/k/v, gate/up in one weight) get one adapter per targeted part, as an unpacked model has.
  The parts' A matrices are stacked into one `lora_A` ([parts * r, in]: one low-rank GEMM reads x once, each
  part's columns have the bits of its own GEMM on the exact backends); each part has its own B.
- The base weights are frozen (`requires_grad=False`) in the model dtype; A and B are parameters in the model
  dtype, so the optimizer (`MasterAdamW`) keeps fp32 masters and AdamW state for them alone and writes the
  16-bit values back in place (parameter addresses, which CUDA graphs captured, never change).
- The model's `state_dict()` keeps HF's base names only (checkpoint and export code is unchanged): adapters are
  saved and loaded in PEFT's format (`save_adapter`, `load_adapter`).
- The reference policy for a KL penalty is the same model with the adapters off (`disable_adapters`,
  `ReferenceView`): no second copy of the weights.
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from exactrl.model.files import writing
from exactrl.model.qwen import CausalLM, Linear, PackedLinear
from exactrl.ops import Ops

# The decoder's linear projections by their HF module names: every one LoRA may target.
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_MLP_TARGETS = ("gate_proj", "up_proj", "down_proj")
LORA_INITS = ("default", "gaussian")
ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
_PEFT_PREFIX = "base_model.model."


@dataclass(frozen=True)
class LoraSpec:
    """What `add_lora` attaches: rank r, alpha (scale alpha / r, or alpha / sqrt(r) with rslora), the targeted
    projections (HF names, every decoder layer), and the init of A (B starts at zero either way)."""

    rank: int
    alpha: float
    target_modules: tuple[str, ...] = LORA_TARGETS
    init: str = "default"
    rslora: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.rank, int) or self.rank < 1:
            raise ValueError(f"LoRA rank must be an integer >= 1, got {self.rank!r}")
        if not (math.isfinite(self.alpha) and self.alpha > 0):
            raise ValueError(f"LoRA alpha must be > 0, got {self.alpha!r}")
        unknown = [t for t in self.target_modules if t not in LORA_TARGETS]
        if unknown or not self.target_modules:
            raise ValueError(
                f"LoRA target_modules {list(self.target_modules)!r}: each must be one of {list(LORA_TARGETS)}"
                + (f" (unknown: {unknown})" if unknown else " (none given)")
            )
        if self.init not in LORA_INITS:
            raise ValueError(f"LoRA init {self.init!r} is not implemented; use one of {list(LORA_INITS)}")

    @property
    def scale(self) -> float:
        # rsLoRA (Kalajdzievski 2023) keeps the update's size independent of r: alpha / sqrt(r).
        return self.alpha / math.sqrt(self.rank) if self.rslora else self.alpha / self.rank


class LoRA(nn.Module):
    """The adapters of one projection (one part, or several parts of a packed one).

    targets: (index of the part in the projection's outputs, HF module path of that part), in output order.
    lora_A: [len(targets) * r, in]; `B(i)` (parameter `lora_B_<i>`): [out of part i, r] for each targeted part
    index i. Plain parameters, no submodules: the state-dict hooks below then cover all of them."""

    def __init__(
        self,
        in_features: int,
        part_sizes: list[int],
        targets: list[tuple[int, str]],
        rank: int,
        scale: float,
        device: torch.device,
        dtype: torch.dtype,
    ):
        super().__init__()
        self.rank, self.scale, self.enabled = rank, scale, True
        self.targets = list(targets)
        self.lora_A = nn.Parameter(torch.zeros(len(targets) * rank, in_features, device=device, dtype=dtype))
        for i, _ in targets:
            self.register_parameter(
                f"lora_B_{i}", nn.Parameter(torch.zeros(part_sizes[i], rank, device=device, dtype=dtype))
            )

    def forward(self, ops: Ops, x: torch.Tensor, outs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        """x: [T, in]; outs: the base outputs per part -> the same with s * (x A_i^T) B_i^T added to part i."""
        n = len(self.targets)
        low = (
            ops.packed_linear(x, self.lora_A, None, [self.rank] * n)
            if n > 1
            else (ops.linear(x, self.lora_A),)
        )
        added = list(outs)
        for (i, _), xa in zip(self.targets, low):
            # Fixed order on both paths: low-rank product, scale (rounded to the model dtype), then the add.
            added[i] = added[i] + ops.linear(xa, self.B(i)) * self.scale
        return tuple(added)

    def part_A(self, j: int) -> torch.Tensor:
        """The A rows of the j-th targeted part: [r, in] (a view)."""
        return self.lora_A[j * self.rank : (j + 1) * self.rank]

    def B(self, i: int) -> nn.Parameter:
        """The B of output part i: [out of part i, r]."""
        return getattr(self, f"lora_B_{i}")

    # Adapters are not part of the model's (HF-named) state dict: they are saved in PEFT's format instead.
    def _save_to_state_dict(self, destination, prefix, keep_vars) -> None:
        return

    def _load_from_state_dict(
        self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
    ) -> None:
        mine = [k for k in state_dict if k.startswith(prefix)]
        if mine:
            error_msgs.append(
                f"{mine[0]}: LoRA adapters are not loaded through the model's state dict; use "
                "exactrl.model.lora.load_adapter on a PEFT adapter directory"
            )


def _projections(model: CausalLM) -> Iterator[tuple[str, Linear]]:
    """(module name, projection) of every decoder linear LoRA may target, in layer order."""
    for name, m in model.model.layers.named_modules(prefix="model.layers"):
        if isinstance(m, Linear):
            yield name, m


def _parts(name: str, m: Linear) -> list[tuple[str, int]]:
    """(HF module path, output rows) of each part of a projection: a packed one's parts live beside it."""
    if isinstance(m, PackedLinear):
        parent = name.rsplit(".", 1)[0]
        return [(f"{parent}.{p}", n) for p, n in m.parts.items()]
    return [(name, m.weight.shape[0])]


def lora_modules(model: nn.Module) -> list[LoRA]:
    return [m for m in model.modules() if isinstance(m, LoRA)]


def has_lora(model: nn.Module) -> bool:
    return bool(lora_modules(model))


def adapter_parameters(model: nn.Module) -> list[nn.Parameter]:
    return [p for m in lora_modules(model) for p in m.parameters()]


@torch.no_grad()
def add_lora(model: CausalLM, spec: LoraSpec, seed: int = 0) -> list[nn.Parameter]:
    """Attach adapters to every targeted projection of every layer, freeze every base parameter, and return the
    adapter parameters (the only ones that require grad from now on).

    Init as PEFT does: B = 0 (the adapted model starts as the base, bit for bit: the added term is +0), A
    kaiming-uniform (`default`: U(-1/sqrt(in), 1/sqrt(in)), torch's nn.Linear init) or N(0, 1/r) (`gaussian`),
    drawn in fp32 from a generator seeded with `seed`, part by part in layer order, then cast."""
    if has_lora(model):
        raise ValueError("the model already has LoRA adapters")
    mlp_targets = [t for t in spec.target_modules if t in _MLP_TARGETS]
    if model.config.is_moe and mlp_targets:
        # The routed experts are stacked weights run by one grouped op (`ops.moe_experts`), not projections an
        # adapter can wrap; adapting only the dense layers' and the shared expert's MLPs would be a silent half.
        raise ValueError(
            f"LoRA target_modules {mlp_targets}: the {model.config.architecture} model routes its MLPs through "
            "experts, which take no adapters; target the attention projections (q_proj, k_proj, v_proj, o_proj)"
        )
    model.requires_grad_(False)
    g = torch.Generator().manual_seed(seed)
    wanted = set(spec.target_modules)
    for name, m in _projections(model):
        parts = _parts(name, m)
        targets = [(i, path) for i, (path, _) in enumerate(parts) if path.rsplit(".", 1)[1] in wanted]
        if not targets:
            continue
        in_features = m.weight.shape[1]
        lora = LoRA(
            in_features,
            [n for _, n in parts],
            targets,
            spec.rank,
            spec.scale,
            m.weight.device,
            m.weight.dtype,
        )
        # A meta-device model (the memory plan's) has shapes only: drawing its init would take seconds for nothing.
        for j in range(0 if m.weight.is_meta else len(targets)):
            if spec.init == "gaussian":
                a = torch.randn(spec.rank, in_features, generator=g) / spec.rank
            else:
                bound = 1.0 / math.sqrt(in_features)
                a = torch.rand(spec.rank, in_features, generator=g) * (2 * bound) - bound
            lora.part_A(j).copy_(a)
        m.lora = lora
    model.lora_spec = spec  # what save_adapter writes into adapter_config.json
    params = adapter_parameters(model)
    if not params:
        raise ValueError(
            f"LoRA target_modules {list(spec.target_modules)} matched no projection of the model"
        )
    return params


def apply_lora_config(model: CausalLM, lora_cfg, seed: int = 0) -> LoraSpec | None:
    """Attach the adapters that a `[lora]` section (exactrl.config.LoraConfig) asks for, and load its
    `path` when set; None (and the model untouched) when rank is 0. Call after the base weights are loaded and
    before the optimizer is built (it optimizes what requires grad: the adapters)."""
    if lora_cfg.rank == 0:
        return None
    if lora_cfg.dropout != 0:
        raise ValueError("lora.dropout must be 0 (dropout would break engine/trainer bitwise equality)")
    spec = LoraSpec(
        rank=lora_cfg.rank,
        alpha=float(lora_cfg.alpha),
        target_modules=tuple(lora_cfg.target_modules),
        init=lora_cfg.init,
        rslora=lora_cfg.rslora,
    )
    add_lora(model, spec, seed=seed)
    if lora_cfg.path is not None:
        loaded = load_adapter(model, lora_cfg.path)
        if set(loaded.target_modules) != set(spec.target_modules):
            raise ValueError(
                f"lora.path {lora_cfg.path}: the adapter targets {list(loaded.target_modules)}, "
                f"lora.target_modules is {list(spec.target_modules)}"
            )
    return spec


@contextmanager
def disable_adapters(model: nn.Module) -> Iterator[None]:
    """Within the block the model computes the base policy (every adapter off): the reference model for a KL
    penalty, with no second copy of the weights. Python-level switch: it acts on eager forwards, not on CUDA
    graphs captured earlier (the engine's decode graphs keep the adapters on, as they should)."""
    mods = lora_modules(model)
    before = [m.enabled for m in mods]
    for m in mods:
        m.enabled = False
    try:
        yield
    finally:
        for m, e in zip(mods, before):
            m.enabled = e


class ReferenceView:
    """The base model behind `model`'s adapters, as the trainer uses a reference model (`model(...)`,
    `.logprobs`, `.device`): each call runs with the adapters off. No weights of its own."""

    def __init__(self, model: CausalLM):
        if not has_lora(model):
            raise ValueError("ReferenceView needs a model with LoRA adapters (otherwise use a frozen copy)")
        self.policy = model

    def __call__(self, *args, **kwargs) -> torch.Tensor:
        with disable_adapters(self.policy):
            return self.policy(*args, **kwargs)

    def logprobs(self, *args, **kwargs):
        return self.policy.logprobs(*args, **kwargs)  # the LM head has no adapter

    def parameters(self):
        return iter(())  # owns nothing: nothing to shard or to optimise

    @property
    def device(self) -> torch.device:
        return self.policy.device

    @property
    def dtype(self) -> torch.dtype:
        return self.policy.dtype


# -- PEFT format -----------------------------------------------------------------------------------------------


@dataclass
class AdapterInfo:
    """What `adapter_config.json` says that matters to the forward."""

    rank: int
    alpha: float
    rslora: bool
    target_modules: list[str] = field(default_factory=list)


def adapter_state_dict(model: CausalLM) -> dict[str, torch.Tensor]:
    """PEFT's names and layout: `base_model.model.<HF module>.lora_A.weight` [r, in] and `.lora_B.weight`
    [out, r] per targeted (unpacked) projection; copies on the CPU."""
    out: dict[str, torch.Tensor] = {}
    for m in lora_modules(model):
        for j, (i, path) in enumerate(m.targets):
            key = f"{_PEFT_PREFIX}{path}"
            out[f"{key}.lora_A.weight"] = m.part_A(j).detach().to("cpu", copy=True).contiguous()
            out[f"{key}.lora_B.weight"] = m.B(i).detach().to("cpu", copy=True).contiguous()
    return out


def adapter_nbytes(model: nn.Module) -> int:
    """Bytes of the adapter weights in the model dtype: what a weight sync after a LoRA step moves."""
    return sum(p.numel() * p.element_size() for p in adapter_parameters(model))


def save_adapter(model: CausalLM, out_dir: str | Path, base_model_name_or_path: str | None = None) -> Path:
    """Write `adapter_model.safetensors` + `adapter_config.json` (PEFT's LoRA format) to out_dir."""
    spec: LoraSpec | None = getattr(model, "lora_spec", None)
    if spec is None or not has_lora(model):
        raise ValueError("the model has no LoRA adapters to save")
    mods = lora_modules(model)
    names = sorted({path.rsplit(".", 1)[1] for m in mods for _, path in m.targets}, key=LORA_TARGETS.index)
    out = Path(out_dir)
    with writing(out, "the LoRA adapter"):
        out.mkdir(parents=True, exist_ok=True)
        save_file(adapter_state_dict(model), str(out / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    doc: dict[str, Any] = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model_name_or_path,
        "r": spec.rank,
        "lora_alpha": spec.alpha,
        "use_rslora": spec.rslora,
        "target_modules": names,
        "lora_dropout": 0.0,
        "bias": "none",
        "fan_in_fan_out": False,
        "use_dora": False,
        "init_lora_weights": True if spec.init == "default" else spec.init,
        "modules_to_save": None,
        "layers_to_transform": None,
        "rank_pattern": {},
        "alpha_pattern": {},
        "inference_mode": True,
    }
    with writing(out, "the LoRA adapter"):
        (out / ADAPTER_CONFIG).write_text(json.dumps(doc, indent=2) + "\n")
    return out


def read_adapter_config(adapter_dir: str | Path) -> AdapterInfo:
    """Read and check a PEFT `adapter_config.json`; options that change the forward and that exactrl does not
    implement are refused by name. (`lora_dropout` is accepted: it acts in training only, and exactrl trains
    without dropout.)"""
    path = Path(adapter_dir) / ADAPTER_CONFIG
    if not path.is_file():
        raise FileNotFoundError(f"{adapter_dir}: no {ADAPTER_CONFIG} (not a PEFT adapter directory)")
    try:
        doc = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: line {e.lineno}: not valid JSON ({e.msg})") from None
    if not isinstance(doc, dict):
        raise ValueError(f"{path}: expected a JSON object")
    if doc.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"{path}: peft_type {doc.get('peft_type')!r}: only LORA adapters are supported")
    refused = {
        "use_dora": (False, None),
        "bias": ("none", None),
        "fan_in_fan_out": (False, None),
        "modules_to_save": (None,),
        "layers_to_transform": (None,),
        "layers_pattern": (None,),
        "rank_pattern": ({}, None),
        "alpha_pattern": ({}, None),
        "use_qalora": (False, None),
        "lora_bias": (False, None),
        "trainable_token_indices": (None,),
        "target_parameters": (None, []),
    }
    for key, allowed in refused.items():
        if key in doc and doc[key] not in allowed:
            raise ValueError(
                f"{path}: {key} = {doc[key]!r} is not supported by exactrl (needs {allowed[0]!r})"
            )
    r, alpha = doc.get("r"), doc.get("lora_alpha")
    if not isinstance(r, int) or r < 1:
        raise ValueError(f"{path}: r must be an integer >= 1, got {r!r}")
    if not isinstance(alpha, int | float) or not alpha > 0:
        raise ValueError(f"{path}: lora_alpha must be a number > 0, got {alpha!r}")
    targets = doc.get("target_modules") or []
    return AdapterInfo(
        r,
        float(alpha),
        bool(doc.get("use_rslora", False)),
        list(targets) if isinstance(targets, list) else [targets],
    )


def checkpoint_adapter(model_dir: str | Path | None) -> Path | None:
    """The LoRA adapters that belong with `model_dir`, when it is a run checkpoint's `policy/` (the frozen base)
    beside an `adapter/` folder; None for any other directory."""
    if model_dir is None:
        return None
    d = Path(model_dir)
    adapter = d.parent / "adapter"
    if d.name == "policy" and (adapter / ADAPTER_CONFIG).is_file():
        return adapter
    return None


def attach_checkpoint_adapter(
    model: CausalLM, model_dir: str | Path | None, base_only: bool, what: str
) -> None:
    """`exactrl eval` / `generate` on a LoRA run's checkpoint: its `policy/` is the base alone, so the adapters
    beside it are loaded (and said on stderr), unless `base_only` asks for the base. A checkpoint of a full
    fine-tune has no `adapter/`: nothing happens."""
    adapter = checkpoint_adapter(model_dir)
    if adapter is None:
        return
    if base_only:
        print(
            f"{what}: the base alone (--base-only); the LoRA adapters in {adapter} are not loaded",
            file=sys.stderr,
        )
        return
    spec = load_adapter(model, adapter)
    print(
        f"{what}: the LoRA adapters in {adapter} (rank {spec.rank}) on the base in {model_dir}",
        file=sys.stderr,
    )


def _adapter_tensors(tensors: dict[str, torch.Tensor], wfile: Path) -> dict[str, dict[str, torch.Tensor]]:
    """{module path: {"lora_A": A, "lora_B": B}} from an adapter file's tensors. PEFT's saved files name a weight
    `<prefix><module>.lora_A.weight`; its in-memory state dict, and files written from it by some PEFT versions
    and tools, keep the adapter's name: `<module>.lora_A.<adapter name>.weight` ("default" unless named). Both
    layouts load; a file that mixes several adapter names (which one would be meant?) is refused by name."""
    found: dict[str, dict[str, torch.Tensor]] = {}
    names: set[str] = set()
    for k, t in tensors.items():
        parts = k.removeprefix(_PEFT_PREFIX).split(".")
        # [... module path ..., "lora_A" | "lora_B", (adapter name,) "weight"]
        at = next(
            (i for i in (len(parts) - 2, len(parts) - 3) if i > 0 and parts[i] in ("lora_A", "lora_B")), None
        )
        if at is None or parts[-1] != "weight":
            raise ValueError(f"{wfile}: tensor {k!r} is not a LoRA A or B weight")
        if at == len(parts) - 3:
            names.add(parts[at + 1])
        module, ab = ".".join(parts[:at]), parts[at]
        if ab in found.get(module, {}):
            raise ValueError(f"{wfile}: {module} has {ab} twice (tensor {k!r})")
        found.setdefault(module, {})[ab] = t
    if len(names) > 1:
        raise ValueError(
            f"{wfile}: tensors of several adapters ({', '.join(sorted(names))}); save one adapter per directory"
        )
    return found


@torch.no_grad()
def load_adapter(model: CausalLM, adapter_dir: str | Path, seed: int = 0) -> LoraSpec:
    """Load a PEFT LoRA adapter into `model`. A model without adapters gets them (shaped by the files); a
    model with adapters must have the same rank, scale and targets and is updated in place (parameter addresses
    kept: the optimizer's and captured CUDA graphs' tensors). Returns the spec the adapter describes."""
    adapter_dir = Path(adapter_dir)
    info = read_adapter_config(adapter_dir)
    wfile = adapter_dir / ADAPTER_WEIGHTS
    if not wfile.is_file():
        raise FileNotFoundError(
            f"{adapter_dir}: no {ADAPTER_WEIGHTS} (pickled adapter_model.bin is not loaded)"
        )
    tensors: dict[str, torch.Tensor] = {}
    with safe_open(str(wfile), framework="pt") as sf:
        for k in sf.keys():
            tensors[k] = sf.get_tensor(k)
    found = _adapter_tensors(tensors, wfile)
    names = sorted(
        {p.rsplit(".", 1)[1] for p in found}, key=lambda n: LORA_TARGETS.index(n) if n in LORA_TARGETS else 99
    )
    bad = [n for n in names if n not in LORA_TARGETS]
    if bad:
        raise ValueError(
            f"{wfile}: adapters on modules {bad} that exactrl's decoder does not have as LoRA targets"
        )
    spec = LoraSpec(rank=info.rank, alpha=info.alpha, target_modules=tuple(names), rslora=info.rslora)
    if not has_lora(model):
        add_lora(model, spec, seed=seed)
    for m in lora_modules(model):
        if m.rank != spec.rank or m.scale != spec.scale:
            raise ValueError(
                f"{adapter_dir}: adapter rank {spec.rank} / scale {spec.scale} differ from the model's adapters "
                f"(rank {m.rank}, scale {m.scale})"
            )
    expected = {path for m in lora_modules(model) for _, path in m.targets}
    missing, unexpected = sorted(expected - set(found)), sorted(set(found) - expected)
    if missing or unexpected:
        raise ValueError(
            f"{wfile}: adapter modules do not match the model's: missing {missing[:4]}, unexpected {unexpected[:4]}"
        )
    for m in lora_modules(model):
        for j, (i, path) in enumerate(m.targets):
            pair = found[path]
            if set(pair) != {"lora_A", "lora_B"}:
                raise ValueError(f"{wfile}: {path} has {sorted(pair)} but needs both lora_A and lora_B")
            a_dst, b_dst = m.part_A(j), m.B(i)
            for ab, src, dst in (("lora_A", pair["lora_A"], a_dst), ("lora_B", pair["lora_B"], b_dst)):
                if tuple(src.shape) != tuple(dst.shape):
                    raise ValueError(
                        f"{wfile}: {_PEFT_PREFIX}{path}.{ab}.weight has shape {tuple(src.shape)}, "
                        f"the model needs {tuple(dst.shape)}"
                    )
                dst.copy_(src)
    return spec


# -- merging and sizes ----------------------------------------------------------------------------------------


@torch.no_grad()
def merged_model(model: CausalLM) -> CausalLM:
    """A copy of `model` without adapters whose weights are W + s B A (computed in fp32, rounded once to the
    model dtype): for `export --merge` and for measuring. Not what the engine runs: its forward is not bitwise
    the unmerged one's (`x (W + s B A)^T` rounds differently from `x W^T + s (x A^T) B^T`)."""
    import copy

    out = copy.deepcopy(model)
    for name, m in _projections(out):
        lora = m.lora
        if not isinstance(lora, LoRA):  # None: no adapter on this projection
            continue
        starts = [0]
        for _, n in _parts(name, m):
            starts.append(starts[-1] + n)
        for j, (i, _) in enumerate(lora.targets):
            delta = lora.scale * (lora.B(i).float() @ lora.part_A(j).float())
            rows = m.weight[starts[i] : starts[i + 1]]
            rows.copy_(rows.float() + delta)
        m.lora = None
    out.lora_spec = None
    return out


def lora_num_params(cfg, spec: LoraSpec) -> int:
    """Adapter parameters for a model config (exactrl.model.ModelConfig) from shapes alone: r * (in + out) per
    targeted projection per layer."""
    h, q, kv, inter = (
        cfg.hidden_size,
        cfg.num_heads * cfg.head_dim,
        cfg.num_kv_heads * cfg.head_dim,
        cfg.intermediate_size,
    )
    shapes = {
        "q_proj": (h, q),
        "k_proj": (h, kv),
        "v_proj": (h, kv),
        "o_proj": (q, h),
        "gate_proj": (h, inter),
        "up_proj": (h, inter),
        "down_proj": (inter, h),
    }
    per_layer = sum(spec.rank * (shapes[t][0] + shapes[t][1]) for t in spec.target_modules)
    return cfg.num_layers * per_layer


def training_state_bytes(num_trainable: int, dtype_bytes: int = 2) -> int:
    """Bytes the optimizer side holds per trainable parameter with MasterAdamW: the weight and its persistent
    gradient in the model dtype, an fp32 master, AdamW's two fp32 moments (4 + 4 + 4 + 2 * dtype_bytes)."""
    return num_trainable * (12 + 2 * dtype_bytes)
