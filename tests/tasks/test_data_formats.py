"""Users' own data: nested field paths (verl's layout), chat records, parquet, chat-template kwargs, and prompts
that do not fit skipped with their file:line in SFT as in RL."""

from __future__ import annotations

import itertools
import json
import sys
from pathlib import Path

import pytest

from exactrl.config import ConfigError, TaskConfig, config_from_dict, dump_toml, load_config
from exactrl.tasks import ChatTemplateError, DatasetError, JsonlTask, make_task
from exactrl.tasks.base import Example
from exactrl.tasks.prompts import PromptEncoder, PromptFilter
from exactrl.train.sft import sft_batches

# Qwen3's way of turning thinking off, cut down: the template reads a variable the caller may pass.
THINKING_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}"
    "{% endif %}"
)


def _verl_records(n: int) -> list[dict]:
    return [
        {
            "data_source": "openai/gsm8k",
            "prompt": [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": f"What is {i}+1?"},
            ],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": str(i + 1)},
            "extra_info": {"index": i, "split": "train"},
        }
        for i in range(n)
    ]


def _write_jsonl(path: Path, records: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


def _check_verl_task(task: JsonlTask, n: int) -> None:
    assert task.num_train + task.num_eval == n
    ex = next(task.train_examples())
    i = ex.meta["extra_info"]["index"]
    assert ex.prompt == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": f"What is {i}+1?"},
    ]
    assert ex.answer == str(i + 1)
    assert ex.meta["data_source"] == "openai/gsm8k" and ex.meta["reward_model"]["style"] == "rule"
    assert "prompt" not in ex.meta


def test_verl_layout_jsonl(tmp_path: Path) -> None:
    path = _write_jsonl(tmp_path / "train.jsonl", _verl_records(10))
    task = make_task("jsonl", path=path, answer_field="reward_model.ground_truth", num_eval=2)
    _check_verl_task(task, 10)
    assert task.num_skipped == 0
    with pytest.raises(
        DatasetError, match=r"missing field 'reward_model.truth' \(no 'truth' in 'reward_model'\)"
    ):
        make_task("jsonl", path=path, answer_field="reward_model.truth", num_eval=2)


def test_verl_layout_parquet(tmp_path: Path) -> None:
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    records = _verl_records(10)
    records[3]["prompt"] = []  # a bad row is skipped and named by its row number
    path = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist(records), path)
    task = make_task("parquet", path=path, answer_field="reward_model.ground_truth", num_eval=2)
    assert task.skipped == [f"{path}:4: field 'prompt' is an empty list of messages"]
    records.pop(3)
    _check_verl_task(task, 9)
    ex = next(iter(task.eval_examples()))
    assert ex.meta["_source"].startswith(f"{path}:")
    with pytest.raises(DatasetError, match='is a parquet file, not JSON Lines: set task.name = "parquet"'):
        make_task("jsonl", path=path, num_eval=2)


def test_parquet_without_pyarrow_names_the_package(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "train.parquet"
    path.write_bytes(b"PAR1" + b"\0" * 16 + b"PAR1")
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # makes `import pyarrow...` raise ImportError
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    with pytest.raises(DatasetError, match=r"needs the pyarrow package \(pip install pyarrow\)"):
        make_task("parquet", path=path)


class _CharTokenizer:
    """One token per character: enough to count prompt lengths."""

    eos_token_id = 0

    def encode(self, text: str) -> list[int]:
        return [ord(c) for c in text]


def test_chat_records_render_with_template_kwargs(tmp_path: Path) -> None:
    records = [{"messages": [{"role": "user", "content": f"q{i}"}], "answer": str(i)} for i in range(5)]
    path = _write_jsonl(tmp_path / "chat.jsonl", records)
    task = JsonlTask(path, prompt_field="messages", num_eval=1)
    ex = task.eval_examples()[0]
    encode = PromptEncoder(_CharTokenizer(), THINKING_TEMPLATE, template_kwargs={"enable_thinking": False})
    text = encode.text(ex)
    assert (
        text
        == f"<|im_start|>user\n{ex.prompt[0]['content']}<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    )
    assert "<think>" not in PromptEncoder(_CharTokenizer(), THINKING_TEMPLATE).text(ex)
    # A system prompt goes first unless the chat has its own.
    with_system = PromptEncoder(_CharTokenizer(), THINKING_TEMPLATE, system_prompt="Be brief.").text(ex)
    assert with_system.startswith("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n")
    # A chat with no template is refused, naming the record.
    with pytest.raises(ChatTemplateError, match=rf"{path}:\d+: this prompt is a list of chat messages"):
        PromptEncoder(_CharTokenizer(), None)(ex)


def test_chat_template_kwargs_config_key(tmp_path: Path) -> None:
    toml = tmp_path / "c.toml"
    toml.write_text(
        '[task]\nname = "parquet"\npath = "x.parquet"\nchat_template_kwargs = {enable_thinking = false}\n'
    )
    toml.write_text(toml.read_text() + '[model]\npreset = "tiny"\n')
    cfg = load_config(toml)
    assert cfg.task.chat_template_kwargs == {"enable_thinking": False}
    from exactrl.config import tomllib  # the stdlib's, or the tomli backport on Python 3.10

    assert config_from_dict(tomllib.loads(dump_toml(cfg))) == cfg
    with pytest.raises(ConfigError, match="task.path"):
        TaskConfig(name="parquet").validate()
    with pytest.raises(ConfigError, match="task.chat_template_kwargs.messages"):
        TaskConfig(chat_template_kwargs={"messages": []}).validate()


def test_too_long_and_empty_prompts_are_skipped_with_their_line_in_sft(tmp_path: Path) -> None:
    records = [{"prompt": f"{i}+1=", "answer": str(i + 1)} for i in range(8)]
    records[2] = {"prompt": "x" * 1_000_000, "answer": "1"}  # line 3: far past any limit
    records[5] = {"prompt": "", "answer": "1"}  # line 6: empty, skipped when the file is read
    path = _write_jsonl(tmp_path / "d.jsonl", records)
    task = JsonlTask(path, num_eval=0)
    assert task.skipped == [f"{path}:6: field 'prompt' is an empty prompt"]
    logged: list[str] = []
    limits = PromptFilter(max_prompt_tokens=16, max_model_len=24, max_new_tokens=8, log=logged.append)
    tok = _CharTokenizer()
    stream = itertools.islice(task.train_examples(seed=0), 14)  # two epochs of 7
    batches = list(sft_batches(stream, PromptEncoder(tok, None), tok, 3, limits, max_skips_in_a_row=15))
    assert len(batches) == 4  # 12 usable examples of 14
    for prompts, completions, masks in batches:
        assert masks is None
        assert all(0 < len(p) <= 16 and len(p) + len(c) <= 24 for p, c in zip(prompts, completions))
    assert limits.skipped == 2
    assert logged[0] == (
        f"{path}:3: the prompt has 1000000 tokens, more than task.max_prompt_tokens = 16; to keep it, raise "
        "task.max_prompt_tokens to 1000000 and engine.max_model_len to at least 1000008: skipped"
    )
    # An answer too long for engine.max_model_len is named too, with the key.
    long_answer = Example("1+1=", "2" * 30, {"_source": "a.jsonl:9"})
    assert not limits.admit(long_answer, tok.encode("1+1="), 31)
    assert logged[-1].startswith(
        "a.jsonl:9: prompt (4 tokens) + answer (31) is longer than engine.max_model_len = 24"
    )
    # Nothing usable: an error instead of a hang.
    only_long = itertools.repeat(Example("y" * 100, "1", {"_source": "b.jsonl:1"}))
    with pytest.raises(ValueError, match="5 examples in a row were skipped"):
        next(sft_batches(only_long, PromptEncoder(tok, None), tok, 2, limits, max_skips_in_a_row=5))


def test_rl_filter_names_the_record() -> None:
    logged: list[str] = []
    limits = PromptFilter(
        max_prompt_tokens=4, max_model_len=12, max_new_tokens=8, log=logged.append, max_logged=1
    )
    assert limits.admit(Example("abcd", "1", {"_source": "d.jsonl:1"}), [1, 2, 3, 4])
    assert not limits.admit(Example("abcde", "1", {"_source": "d.jsonl:2"}), [1] * 5)
    assert not limits.admit(Example("", "1", {"_source": "d.jsonl:3"}), [])
    assert limits.skipped == 2
    assert logged == [
        "d.jsonl:2: the prompt has 5 tokens, more than task.max_prompt_tokens = 4; to keep it, raise "
        "task.max_prompt_tokens to 5 and engine.max_model_len to at least 13: skipped",
        "more than 1 prompts skipped: further ones are counted, not listed",
    ]
