"""Tests for exactrl.config: TOML load/save, type checking, overrides, docs and validation."""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, get_type_hints

import pytest
import tomllib
from hypothesis import given, settings
from hypothesis import strategies as st

from exactrl.config import (
    AlgorithmConfig,
    ConfigError,
    RunConfig,
    apply_overrides,
    config_from_dict,
    config_reference_markdown,
    config_to_dict,
    dump_toml,
    field_docs,
    load_config,
    parse_override,
    resolve_device,
    save_config,
)

PRESET = ["model.preset=tiny"]


def write(tmp_path: Path, text: str, name: str = "cfg.toml") -> Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


def sections() -> list[tuple[str, type]]:
    """(name, class) of every section of RunConfig."""
    hints = get_type_hints(RunConfig)
    return [(f.name, hints[f.name]) for f in dataclasses.fields(RunConfig)]


# ----------------------------------------------------------------------------------------------------------
# Loading
# ----------------------------------------------------------------------------------------------------------


def test_load_toml_file(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        """
[run]
name = "demo"
seed = 7
exact = false

[model]
preset = "tiny"
dtype = "bfloat16"

[sampling]
temperature = 0.7
stop = ["\\n\\n", "###"]
stop_token_ids = [2, 3]

[algorithm]
name = "gspo"
group_size = 4
rollouts_per_step = 32
dual_clip = 3
rollout_correction = "icepop"

[train]
lr = 1          # an int is accepted for a float field
betas = [0, 0.95]
""",
    )
    cfg = load_config(path)
    assert cfg.run.name == "demo" and cfg.run.seed == 7 and cfg.run.exact is False
    assert cfg.model.preset == "tiny" and cfg.model.dtype == "bfloat16" and cfg.model.path is None
    assert cfg.sampling.stop == ["\n\n", "###"] and cfg.sampling.stop_token_ids == [2, 3]
    assert cfg.algorithm.name == "gspo" and cfg.algorithm.prompts_per_step == 8
    assert cfg.algorithm.dual_clip == 3.0 and type(cfg.algorithm.dual_clip) is float
    assert cfg.algorithm.rollout_correction == "icepop"
    assert cfg.train.lr == 1.0 and type(cfg.train.lr) is float
    assert cfg.train.betas == [0.0, 0.95] and all(type(b) is float for b in cfg.train.betas)
    # untouched keys keep their defaults
    assert cfg.engine == RunConfig().engine
    assert cfg.train.steps == 100 and cfg.algorithm.value_clip == 0.2


def test_load_without_file_gives_defaults() -> None:
    cfg = load_config(None, PRESET)
    expected = RunConfig()
    expected.model.preset = "tiny"
    assert cfg == expected


def test_defaults_list_fields_are_independent() -> None:
    a, b = RunConfig(), RunConfig()
    a.task.arithmetic_ops.append("*")
    assert b.task.arithmetic_ops == ["+", "-"]


def test_invalid_toml_names_file(tmp_path: Path) -> None:
    path = write(tmp_path, "[train\nlr = 1\n")
    with pytest.raises(ConfigError, match="invalid TOML in .*cfg.toml"):
        load_config(path)


def test_config_error_is_value_error_with_key(tmp_path: Path) -> None:
    path = write(tmp_path, '[train]\nlr = "abc"\n')
    with pytest.raises(ValueError) as info:
        load_config(path)
    assert isinstance(info.value, ConfigError) and info.value.key == "train.lr"


# ----------------------------------------------------------------------------------------------------------
# Round trip
# ----------------------------------------------------------------------------------------------------------


def _nondefault_config() -> RunConfig:
    cfg = RunConfig()
    cfg.run.name = 'quote " backslash \\ tab \t newline \n nul \x00 del \x7f unicode é 漢字 🙂'
    cfg.model.path = "/models/Qwen3-0.6B"
    cfg.model.tokenizer = "C:\\tok\\tokenizer.json"
    cfg.engine.num_kv_blocks = 1024
    cfg.sampling.temperature = 0.1 + 0.2  # 0.30000000000000004
    cfg.sampling.top_p = 1e-300
    cfg.sampling.stop = ["\n\n", "", "]"]
    cfg.sampling.stop_token_ids = [0, 151643]
    cfg.task.system_prompt = "Answer with a number."
    cfg.task.arithmetic_ops = []
    cfg.reward.weights = [0.5, 5e-324, -2.0]
    cfg.algorithm.dual_clip = 3.0
    cfg.algorithm.value_clip = None  # None where the default is not None
    cfg.algorithm.rollout_correction = "seq-mis"
    cfg.train.lr = 3.14159e-7
    cfg.train.betas = [0.9, 0.95]
    cfg.train.critic_lr = math.inf
    cfg.sft.checkpoint = "runs/sft/ckpt"
    return cfg


@pytest.mark.parametrize("make", [RunConfig, _nondefault_config])
def test_round_trip(make, tmp_path: Path) -> None:
    cfg = make()
    text = dump_toml(cfg)
    assert config_from_dict(tomllib.loads(text)) == cfg
    assert dump_toml(config_from_dict(tomllib.loads(text))) == text  # stable
    path = tmp_path / "sub" / "dir" / "config.toml"
    save_config(cfg, path)
    assert path.read_text(encoding="utf-8") == text
    assert not list(path.parent.glob("*.tmp"))
    assert config_from_dict(tomllib.loads(path.read_text(encoding="utf-8"))) == cfg


def test_round_trip_through_load_config(tmp_path: Path) -> None:
    cfg = load_config(None, [*PRESET, "algorithm.value_clip=none", "train.lr=0.1"])
    path = tmp_path / "saved.toml"
    save_config(cfg, path)
    assert load_config(path) == cfg


def test_round_trip_negative_zero_and_float_bits() -> None:
    cfg = RunConfig()
    cfg.algorithm.entropy_coef = -0.0
    cfg.reward.weights = [1 / 3, 2.0**-1074, 1.7976931348623157e308]
    back = config_from_dict(tomllib.loads(dump_toml(cfg)))
    assert math.copysign(1.0, back.algorithm.entropy_coef) == -1.0
    assert [w.hex() for w in back.reward.weights] == [w.hex() for w in cfg.reward.weights]


@settings(max_examples=60, deadline=None)
@given(
    name=st.text(),
    stop=st.lists(st.text(max_size=5), max_size=4),
    lr=st.floats(allow_nan=False),
    weights=st.lists(st.floats(allow_nan=False), max_size=4),
    seed=st.integers(min_value=-(2**63), max_value=2**63 - 1),
    prompt=st.one_of(st.none(), st.text(max_size=20)),
)
def test_round_trip_property(name, stop, lr, weights, seed, prompt) -> None:
    cfg = RunConfig()
    cfg.run.name, cfg.run.seed, cfg.sampling.stop = name, seed, stop
    cfg.train.lr, cfg.reward.weights = lr, weights
    if prompt is not None and prompt.strip().lower() in ("none", "null"):
        prompt = None  # these spell None on an optional field
    cfg.task.system_prompt = prompt
    assert config_from_dict(tomllib.loads(dump_toml(cfg))) == cfg


def test_dump_omits_none_defaults_and_writes_all_sections() -> None:
    text = dump_toml(RunConfig())
    parsed = tomllib.loads(text)
    assert list(parsed) == [f.name for f in dataclasses.fields(RunConfig)]
    assert "preset" not in parsed["model"] and "dual_clip" not in parsed["algorithm"]
    assert parsed["algorithm"]["value_clip"] == 0.2
    cfg = RunConfig()
    cfg.algorithm.value_clip = None
    assert tomllib.loads(dump_toml(cfg))["algorithm"]["value_clip"] == "none"


def test_config_to_dict() -> None:
    cfg = _nondefault_config()
    d = config_to_dict(cfg)
    assert d["algorithm"]["value_clip"] is None and d["model"]["preset"] is None
    assert d["train"]["betas"] == [0.9, 0.95]
    d["train"]["betas"].append(0.0)
    assert cfg.train.betas == [0.9, 0.95]  # a copy
    d["train"]["betas"].pop()
    assert config_from_dict(d) == cfg
    json.dumps(config_to_dict(RunConfig()))  # plain data
    with pytest.raises(TypeError):
        config_to_dict({"a": 1})


# ----------------------------------------------------------------------------------------------------------
# Unknown keys and sections
# ----------------------------------------------------------------------------------------------------------


def test_unknown_key_with_suggestion(tmp_path: Path) -> None:
    path = write(tmp_path, "[train]\nlrr = 1e-5\n", name="x.toml")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert str(info.value) == f"unknown key 'train.lrr' in {path}; did you mean 'train.lr'?"
    assert info.value.key == "train.lrr"


def test_unknown_key_in_wrong_section_suggests_right_one(tmp_path: Path) -> None:
    path = write(tmp_path, "[train]\ngroup_size = 4\n")
    with pytest.raises(
        ConfigError, match=r"unknown key 'train.group_size' .*did you mean 'algorithm.group_size'"
    ):
        load_config(path)


def test_unknown_key_without_match_lists_valid_keys(tmp_path: Path) -> None:
    path = write(tmp_path, "[sft]\nzzzzzz = 1\n")
    with pytest.raises(ConfigError, match=r"unknown key 'sft.zzzzzz' .*valid keys in \[sft\]: steps, lr,"):
        load_config(path)


def test_unknown_section(tmp_path: Path) -> None:
    path = write(tmp_path, "[trian]\nlr = 1e-5\n", name="x.toml")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert str(info.value) == f"unknown section '[trian]' in {path}; did you mean '[train]'?"


def test_unknown_top_level_key(tmp_path: Path) -> None:
    path = write(tmp_path, "lr = 1e-5\n")
    with pytest.raises(ConfigError, match=r"unknown key 'lr' .*did you mean 'train.lr'"):
        load_config(path)


def test_unknown_subsection(tmp_path: Path) -> None:
    path = write(tmp_path, "[train.optim]\nlr = 1\n")
    with pytest.raises(ConfigError, match=r"unknown section '\[train.optim\]'"):
        load_config(path)


# ----------------------------------------------------------------------------------------------------------
# Type checking
# ----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "toml, message",
    [
        # int
        ('[run]\nseed = "1"', "run.seed: expected int, got '1' (str)"),
        ("[run]\nseed = 1.0", "run.seed: expected int, got 1.0 (float)"),
        ("[run]\nseed = true", "run.seed: expected int, got True (bool)"),
        # float
        ('[train]\nlr = "abc"', "train.lr: expected float, got 'abc' (str)"),
        ("[train]\nlr = false", "train.lr: expected float, got False (bool)"),
        ("[train]\nlr = [1e-5]", "train.lr: expected float, got [1e-05] (list)"),
        # bool
        ("[run]\nexact = 1", "run.exact: expected bool, got 1 (int)"),
        ('[run]\nexact = "true"', "run.exact: expected bool, got 'true' (str)"),
        # str
        ("[run]\nname = 3", "run.name: expected str, got 3 (int)"),
        ("[run]\ndevice = true", "run.device: expected str, got True (bool)"),
        # list
        ('[sampling]\nstop = "x"', "sampling.stop: expected list[str], got 'x' (str)"),
        ('[sampling]\nstop_token_ids = [1, "2"]', "sampling.stop_token_ids[1]: expected int, got '2' (str)"),
        ("[train]\nbetas = [0.9, true]", "train.betas[1]: expected float, got True (bool)"),
        # Literal
        (
            '[algorithm]\nname = "grp"',
            "algorithm.name: expected one of 'grpo', 'dr_grpo', 'rloo', 'gspo', 'ppo', got 'grp' (str)",
        ),
        ('[model]\ndtype = "fp16"', "model.dtype: expected one of 'float32', 'bfloat16', got 'fp16' (str)"),
        (
            "[train]\nlr_schedule = 1",
            "train.lr_schedule: expected one of 'constant', 'cosine', 'linear', got 1",
        ),
        (
            '[train]\nfsdp_fp8_copies = "per-use"',
            "train.fsdp_fp8_copies: expected one of 'kept', 'per_use', got 'per-use' (str)",
        ),
        # optional
        ('[algorithm]\ndual_clip = "x"', "algorithm.dual_clip: expected float | None, got 'x' (str)"),
        ("[engine]\nnum_kv_blocks = 1.5", "engine.num_kv_blocks: expected int | None, got 1.5 (float)"),
        ("[model]\npath = 5", "model.path: expected str | None, got 5 (int)"),
        (
            '[algorithm]\nrollout_correction = "tis"',
            "algorithm.rollout_correction: expected one of 'token-tis', 'seq-tis', 'token-mis', 'seq-mis', "
            "'icepop' or None, got 'tis' (str)",
        ),
        # sections and tables
        ("train = 3", "train: expected table, got 3 (int)"),
        ("[train.lr]\nx = 1", "train.lr: expected float, got {'x': 1} (dict)"),
    ],
)
def test_wrong_types(tmp_path: Path, toml: str, message: str) -> None:
    path = write(tmp_path, toml + "\n")
    with pytest.raises(ConfigError) as info:
        load_config(path, PRESET)
    assert str(info.value).startswith(message), str(info.value)
    assert str(path) in str(info.value)


def test_fsdp_fp8_copies_is_checked_when_set_in_code() -> None:
    """A config built in code skips the loader's Literal check: validate() names the key and its two values."""
    cfg = load_config(None, PRESET)
    cfg.train.fsdp_fp8_copies = "per-use"  # type: ignore[assignment]
    with pytest.raises(ConfigError, match='train.fsdp_fp8_copies.*"kept" or "per_use"'):
        cfg.validate()


def test_literal_typo_gets_suggestion() -> None:
    with pytest.raises(ConfigError, match="did you mean 'grpo'"):
        config_from_dict({"algorithm": {"name": "grppo"}})


def test_none_words_on_optional_fields() -> None:
    cfg = config_from_dict(
        {"algorithm": {"value_clip": "none", "dual_clip": "NULL"}, "model": {"path": "None"}}
    )
    assert cfg.algorithm.value_clip is None and cfg.algorithm.dual_clip is None and cfg.model.path is None
    with pytest.raises(ConfigError, match="train.lr: expected float, got 'none'"):
        config_from_dict({"train": {"lr": "none"}})
    with pytest.raises(ConfigError, match=r"train.lr: expected float, got None \(NoneType\)"):
        config_from_dict({"train": {"lr": None}})


# ----------------------------------------------------------------------------------------------------------
# --set overrides
# ----------------------------------------------------------------------------------------------------------


def test_overrides_applied_after_file(tmp_path: Path) -> None:
    path = write(tmp_path, '[model]\npreset = "tiny"\n[train]\nlr = 1e-4\nsteps = 5\n')
    cfg = load_config(
        path,
        [
            "train.lr=3e-6",
            "train.steps=10",
            "train.steps=20",  # last one wins
            "run.exact=false",
            "run.name=my-run",  # bare word -> string
            'run.output_dir="runs/x y"',  # quoted string
            "sampling.stop=['\\n', \"###\"]",
            "sampling.stop_token_ids=[1, 2]",
            "train.betas=[0, 0.9]",
            "algorithm.name=ppo",
            "algorithm.rollout_correction=token-tis",
            "algorithm.dual_clip=3",
            "engine.num_kv_blocks = 512",
            "task.system_prompt=Be brief = please",  # '=' inside the value
        ],
    )
    assert cfg.train.lr == 3e-6 and cfg.train.steps == 20
    assert cfg.run.exact is False and cfg.run.name == "my-run" and cfg.run.output_dir == "runs/x y"
    assert cfg.sampling.stop == ["\\n", "###"]  # TOML literal string: no escapes
    assert cfg.sampling.stop_token_ids == [1, 2]
    assert cfg.train.betas == [0.0, 0.9] and type(cfg.train.betas[0]) is float
    assert cfg.algorithm.name == "ppo" and cfg.algorithm.rollout_correction == "token-tis"
    assert cfg.algorithm.dual_clip == 3.0 and type(cfg.algorithm.dual_clip) is float
    assert cfg.engine.num_kv_blocks == 512
    assert cfg.task.system_prompt == "Be brief = please"


def test_overrides_none_able_fields() -> None:
    cfg = load_config(None, [*PRESET, "algorithm.value_clip=none", "model.tokenizer=tok.json"])
    assert cfg.algorithm.value_clip is None and cfg.model.tokenizer == "tok.json"
    cfg = load_config(
        None, ["model.preset=tiny", "model.preset=null", "model.path=/ckpt", "algorithm.value_clip=0.5"]
    )
    assert cfg.model.preset is None and cfg.model.path == "/ckpt" and cfg.algorithm.value_clip == 0.5
    cfg = load_config(
        None, [*PRESET, "algorithm.rollout_correction=seq-tis", "algorithm.rollout_correction=None"]
    )
    assert cfg.algorithm.rollout_correction is None


def test_overrides_lists() -> None:
    cfg = load_config(None, [*PRESET, "sampling.stop=[]", "task.arithmetic_ops=['*']", "reward.weights=[2]"])
    assert cfg.sampling.stop == [] and cfg.task.arithmetic_ops == ["*"] and cfg.reward.weights == [2.0]
    with pytest.raises(ConfigError, match=r"sampling.stop_token_ids\[0\]: expected int, got 'a'"):
        load_config(None, [*PRESET, "sampling.stop_token_ids=['a']"])
    with pytest.raises(ConfigError, match="sampling.stop: expected list"):
        load_config(None, [*PRESET, "sampling.stop=foo"])


def test_override_value_coercions() -> None:
    cfg = load_config(None, [*PRESET, "run.name=42", "train.lr=.5", "run.device=cuda:1", "sampling.top_p=1"])
    assert cfg.run.name == "42" and cfg.train.lr == 0.5 and cfg.run.device == "cuda:1"
    assert cfg.sampling.top_p == 1.0 and type(cfg.sampling.top_p) is float
    with pytest.raises(ConfigError, match=r"run.seed: expected int, got 1.5 \(float\) in --set run.seed=1.5"):
        load_config(None, [*PRESET, "run.seed=1.5"])
    with pytest.raises(ConfigError, match=r"run.exact: expected bool, got 1 \(int\)"):
        load_config(None, [*PRESET, "run.exact=1"])
    with pytest.raises(
        ConfigError, match=r"train.lr: expected float, got 'abc' \(str\) in --set train.lr=abc"
    ):
        load_config(None, [*PRESET, "train.lr=abc"])


def test_override_errors() -> None:
    with pytest.raises(
        ConfigError, match=r"unknown key 'train.lrr' in --set train.lrr=1; did you mean 'train.lr'\?"
    ):
        load_config(None, ["train.lrr=1"])
    with pytest.raises(ConfigError, match=r"unknown section '\[trian\]' .*did you mean '\[train\]'"):
        load_config(None, ["trian.lr=1"])
    with pytest.raises(ConfigError, match="'train' is a section"):
        load_config(None, ["train=1"])
    with pytest.raises(ConfigError, match="'train.lr' is not a section"):
        load_config(None, ["train.lr.x=1"])
    with pytest.raises(ConfigError, match="expected section.key=value"):
        load_config(None, ["train.lr"])
    with pytest.raises(ConfigError, match="expected section.key=value"):
        load_config(None, ["=1"])


def test_apply_overrides_returns_copy() -> None:
    cfg = RunConfig()
    new = apply_overrides(cfg, ["train.lr=0.1", "sampling.stop=['x']"])
    assert new.train.lr == 0.1 and new.sampling.stop == ["x"]
    assert cfg == RunConfig()


def test_parse_override() -> None:
    assert parse_override("train.lr=1e-5") == ("train.lr", 1e-5)
    assert parse_override(" a.b = true ") == ("a.b", True)
    assert parse_override("a.b=[1, 2]") == ("a.b", [1, 2])
    assert parse_override('a.b="x y"') == ("a.b", "x y")
    assert parse_override("a.b=hello world") == ("a.b", "hello world")
    assert parse_override("a.b=") == ("a.b", "")
    assert parse_override("a.b=1\nc = 2") == ("a.b", "1\nc = 2")  # no smuggled keys


def test_overrides_are_validated() -> None:
    with pytest.raises(ConfigError, match="algorithm.rollouts_per_step"):
        load_config(None, [*PRESET, "algorithm.group_size=7"])


# ----------------------------------------------------------------------------------------------------------
# Docs
# ----------------------------------------------------------------------------------------------------------


def test_every_field_documented() -> None:
    top = field_docs(RunConfig)
    assert set(top) == {f.name for f in dataclasses.fields(RunConfig)}
    for name, cls in sections():
        assert top[name].strip(), f"section [{name}] has no doc"
        docs = field_docs(cls)
        assert set(docs) == {f.name for f in dataclasses.fields(cls)}
        missing = [k for k, v in docs.items() if not v.strip()]
        assert not missing, f"[{name}] fields without a docstring: {missing}"
        assert cls.__doc__ and not cls.__doc__.startswith(cls.__name__ + "(")


def test_reference_markdown_lists_every_key() -> None:
    md = config_reference_markdown()
    assert md.startswith("# Configuration reference")
    for name, cls in sections():
        assert f"## `[{name}]`" in md
        for f in dataclasses.fields(cls):
            assert f"| `{f.name}` |" in md
    assert "| `lr` | `float` | `1e-05` |" in md
    assert "| `dual_clip` | `float \\| None` | *unset* |" in md
    assert "| `stop` | `list[str]` | `[]` |" in md
    assert '`"grpo" \\| "dr_grpo" \\| "rloo" \\| "gspo" \\| "ppo"`' in md
    rows = [line for line in md.splitlines() if line.startswith("| `")]
    assert len(rows) == sum(len(dataclasses.fields(cls)) for _, cls in sections())


@dataclass
class _Base:
    """Base."""

    a: int = 1
    """Doc of a,
    on two lines."""


@dataclass
class _Child(_Base):
    """Child."""

    b: str = "x"
    c: float = 0.5
    """Doc of c."""


def test_field_docs_generic() -> None:
    assert field_docs(_Child) == {"a": "Doc of a,\non two lines.", "b": "", "c": "Doc of c."}


# ----------------------------------------------------------------------------------------------------------
# Generic machinery on another dataclass tree
# ----------------------------------------------------------------------------------------------------------


@dataclass
class _Leaf:
    """Leaf."""

    mode: Literal["a", "b"] = "a"
    """Mode."""
    scale: float | None = 1.0
    """Scale."""


@dataclass
class _Mid:
    """Mid."""

    required: int
    """Required."""
    leaf: _Leaf = field(default_factory=_Leaf)
    """Nested table."""
    tags: dict[str, float] = field(default_factory=dict)
    """Tags."""


@dataclass
class _Root:
    """Root."""

    top: str = "t"
    """Top-level scalar."""
    mid: _Mid = field(default_factory=lambda: _Mid(required=0))
    """Middle table."""


def test_generic_nested_tree(tmp_path: Path) -> None:
    cfg = _Root(top="q", mid=_Mid(required=3, leaf=_Leaf(mode="b", scale=None), tags={"a b": 1.5, "c": 2.0}))
    text = dump_toml(cfg)
    assert "[mid.leaf]" in text and '"a b" = 1.5' in text
    assert config_from_dict(tomllib.loads(text), _Root) == cfg
    path = write(tmp_path, text)
    assert load_config(path, ["mid.leaf.scale=2", "mid.tags={x = 1}"], cls=_Root) == dataclasses.replace(
        cfg, mid=_Mid(required=3, leaf=_Leaf(mode="b", scale=2.0), tags={"x": 1.0})
    )
    with pytest.raises(ConfigError, match="missing required key 'mid.required'"):
        config_from_dict({"mid": {}}, _Root)
    with pytest.raises(ConfigError, match=r"unknown key 'mid.leaf.mood'.*did you mean 'mid.leaf.mode'"):
        config_from_dict({"mid": {"required": 1, "leaf": {"mood": "a"}}}, _Root)
    with pytest.raises(ConfigError, match=r"mid.tags.x: expected float, got 'y'"):
        config_from_dict({"mid": {"required": 1, "tags": {"x": "y"}}}, _Root)
    md = config_reference_markdown(_Root)
    assert "## Top-level keys" in md and "## `[mid]`" in md and "## `[mid.leaf]`" in md
    assert "| `required` | `int` | *required* |" in md


# ----------------------------------------------------------------------------------------------------------
# Validation
# ----------------------------------------------------------------------------------------------------------


def test_defaults_with_model_are_valid() -> None:
    load_config(None, PRESET).validate()
    load_config(None, ["model.path=/ckpt"]).validate()


@pytest.mark.parametrize(
    "overrides, key, text",
    [
        (["model.preset=none"], "model.preset", "exactly one"),
        (["model.path=/ckpt"], "model.preset", "exactly one"),
        (["run.device=gpu"], "run.device", "'gpu'"),
        (["run.log_every=0"], "run.log_every", ">= 1"),
        (["engine.block_size=24"], "engine.block_size", "multiple of 16"),
        (["engine.kv_memory_fraction=0"], "engine.kv_memory_fraction", "(0, 1]"),
        (["engine.num_kv_blocks=0"], "engine.num_kv_blocks", ">= 1"),
        (["engine.prefill_chunk_size=8192"], "engine.prefill_chunk_size", "max_num_batched_tokens"),
        (["sampling.top_p=0"], "sampling.top_p", "(0, 1]"),
        (["sampling.top_p=1.5"], "sampling.top_p", "(0, 1]"),
        (["sampling.temperature=-1"], "sampling.temperature", ">= 0"),
        (["sampling.stop=['']"], "sampling.stop[0]", "empty"),
        (["task.name=jsonl"], "task.path", "required"),
        (["task.arithmetic_ops=['/']"], "task.arithmetic_ops[0]", "'/'"),
        (["task.arithmetic_ops=['+', '+']"], "task.arithmetic_ops", "duplicates"),
        (["task.eval_samples=0"], "task.eval_samples", ">= 1"),
        (["reward.functions=[]"], "reward.functions", "at least one"),
        (["reward.weights=[1.0, 2.0]"], "reward.weights", "one weight per function"),
        (["algorithm.group_size=0"], "algorithm.group_size", ">= 1"),
        (
            ["algorithm.rollouts_per_step=60"],
            "algorithm.rollouts_per_step",
            "divisible by algorithm.group_size",
        ),
        (["algorithm.minibatches_per_rollout=3"], "algorithm.rollouts_per_step", "minibatches_per_rollout"),
        (["algorithm.name=rloo", "algorithm.group_size=1"], "algorithm.group_size", ">= 2"),
        (["algorithm.name=grpo", "algorithm.group_size=1"], "algorithm.group_size", "every advantage zero"),
        (
            ["algorithm.name=dr_grpo", "algorithm.group_size=1"],
            "algorithm.group_size",
            'algorithm.name = "ppo"',
        ),
        (["algorithm.name=gspo", "algorithm.group_size=1"], "algorithm.group_size", ">= 2"),
        (["algorithm.dual_clip=0.5"], "algorithm.dual_clip", "> 1"),
        (["algorithm.eps_low=1"], "algorithm.eps_low", "[0, 1)"),
        (["algorithm.gamma=1.1"], "algorithm.gamma", "[0, 1]"),
        (["algorithm.value_clip=0"], "algorithm.value_clip", "> 0"),
        (["algorithm.kl_coef=-0.1"], "algorithm.kl_coef", ">= 0"),
        (["train.lr=0"], "train.lr", "> 0"),
        (["train.lr=-1e-5"], "train.lr", "> 0"),
        (["train.lr=nan"], "train.lr", "> 0"),
        (["train.betas=[0.9]"], "train.betas", "exactly 2"),
        (["train.betas=[0.9, 1.0]"], "train.betas[1]", "[0, 1)"),
        (["train.keep_checkpoints=0"], "train.keep_checkpoints", ">= 1"),
        (["sft.lr=0"], "sft.lr", "> 0"),
        (["sft.checkpoint=ck", "sft.steps=5"], "sft.checkpoint", "not both"),
        (["sampling.max_tokens=4000"], "engine.max_model_len", "max_prompt_tokens + sampling.max_tokens"),
        (
            ["train.max_tokens_per_microbatch=100"],
            "train.max_tokens_per_microbatch",
            "max_prompt_tokens + sampling.max_tokens",
        ),
    ],
)
def test_validate_errors(overrides: list[str], key: str, text: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(None, [*PRESET, *overrides])
    message = str(info.value)
    assert info.value.key == key, message
    assert message.startswith(key), message
    assert text in message, message


def test_validate_on_instance() -> None:
    cfg = RunConfig()
    with pytest.raises(ConfigError, match="model"):
        cfg.validate()
    cfg.model.preset = "tiny"
    cfg.validate()
    assert AlgorithmConfig(group_size=4, rollouts_per_step=16).prompts_per_step == 4


# ----------------------------------------------------------------------------------------------------------
# Device
# ----------------------------------------------------------------------------------------------------------


def test_resolve_device(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    assert resolve_device("cpu") == "cpu"
    assert resolve_device(torch.device("cpu")) == "cpu"
    assert resolve_device(load_config(None, [*PRESET, "run.device=cuda:1"])) == "cuda:1"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device(RunConfig()) == "cpu"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert resolve_device("auto") == "cuda"
