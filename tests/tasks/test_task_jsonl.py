"""JsonlTask: loading, error messages with file:line, the held-out split and resume."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest

from exactrl.tasks import DatasetError, DatasetNotFoundError, JsonlTask, Task


def _write(path: Path, records: list) -> Path:
    lines = [r if isinstance(r, str) else json.dumps(r) for r in records]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def _dataset(tmp_path: Path, n: int = 50) -> Path:
    return _write(
        tmp_path / "data.jsonl", [{"prompt": f"{i}+1=", "answer": str(i + 1), "id": i} for i in range(n)]
    )


def test_good_file_split_and_meta(tmp_path: Path) -> None:
    path = _dataset(tmp_path)
    task = JsonlTask(path, num_eval=10)
    assert isinstance(task, Task)
    assert (task.num_train, task.num_eval) == (40, 10)
    eval_prompts = {e.prompt for e in task.eval_examples()}
    train = list(itertools.islice(task.train_examples(), 40))
    assert {e.prompt for e in train}.isdisjoint(eval_prompts)
    assert len({e.prompt for e in train}) == 40  # one epoch = every training example once
    ex = train[0]
    assert ex.answer == str(ex.meta["id"] + 1)
    assert ex.meta["_source"].startswith(f"{path}:")
    # The split depends on the seed, deterministically.
    assert [e.prompt for e in JsonlTask(path, num_eval=10).eval_examples()] == [
        e.prompt for e in task.eval_examples()
    ]
    assert {e.prompt for e in JsonlTask(path, num_eval=10, seed=1).eval_examples()} != eval_prompts
    assert len(task.eval_examples(3)) == 3


def test_eval_path_and_overlap_removed(tmp_path: Path) -> None:
    train = _dataset(tmp_path, 20)
    held = _write(
        tmp_path / "eval.jsonl", [{"prompt": "3+1=", "answer": 4}, {"prompt": "new=", "answer": "x"}]
    )
    task = JsonlTask(train, eval_path=held)
    assert task.num_eval == 2
    assert task.num_train == 19 and task.num_dropped_overlap == 1
    assert "3+1=" not in {e.prompt for e in itertools.islice(task.train_examples(), 60)}


def test_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "nope.jsonl"
    with pytest.raises(DatasetNotFoundError, match="nope.jsonl") as info:
        JsonlTask(path)
    assert isinstance(info.value, FileNotFoundError) and isinstance(info.value, DatasetError)
    with pytest.raises(FileNotFoundError, match="missing_eval"):
        JsonlTask(_dataset(tmp_path), eval_path=tmp_path / "missing_eval.jsonl")


def test_bad_records_are_skipped_and_named(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    good = [{"prompt": f"{i}+1=", "answer": str(i + 1)} for i in range(6)]
    lines = [
        good[0],
        '{"prompt": "b", "answer": ',  # 2: invalid JSON
        good[1],
        '["a", "b"]',  # 4: not an object
        {"prompt": "c", "solution": "2"},  # 5: missing field
        {"prompt": ["a"], "answer": "1"},  # 6: wrong type (a list that is not messages)
        {"prompt": "d", "answer": None},  # 7: wrong answer type
        {"prompt": "  ", "answer": "1"},  # 8: empty prompt
        "",  # blank lines are not records
        good[2],
        good[3],
        good[4],
        good[5],
    ]
    path = _write(tmp_path / "bad.jsonl", lines)
    with caplog.at_level("WARNING"):
        task = JsonlTask(path, num_eval=2)
    assert task.num_train + task.num_eval == 6
    assert task.num_skipped == 6
    reasons = dict(s.removeprefix(f"{path}:").split(": ", 1) for s in task.skipped)
    assert set(reasons) == {"2", "4", "5", "6", "7", "8"}
    assert reasons["2"].startswith("invalid JSON")
    assert reasons["4"].startswith("expected a JSON object")
    assert "missing field 'answer'" in reasons["5"] and "'solution'" in reasons["5"]
    assert "field 'prompt'[0] must be a message" in reasons["6"]
    assert "field 'answer' must be a string or a finite number" in reasons["7"]
    assert "empty prompt" in reasons["8"]
    assert f"{path}:5: missing field 'answer'" in caplog.text


def test_no_usable_record_is_an_error(tmp_path: Path) -> None:
    path = _write(tmp_path / "d.jsonl", [{"question": "a", "answer": "1"}, {"question": "b", "answer": "2"}])
    with pytest.raises(
        DatasetError, match=r"(?s)no usable record \(2 skipped\).*d.jsonl:1: missing field 'prompt'"
    ):
        JsonlTask(path)
    chat = _write(tmp_path / "chat.jsonl", [{"messages": [{"role": "user", "content": "hi"}], "answer": "1"}])
    with pytest.raises(DatasetError, match='set task.prompt_field = "messages"'):
        JsonlTask(chat)


def test_bad_utf8_names_its_line(tmp_path: Path) -> None:
    path = tmp_path / "u.jsonl"
    lines = [json.dumps({"prompt": f"p{i}", "answer": "1"}).encode() for i in range(30)]
    lines[20] = b'{"prompt": "caf\xe9", "answer": "1"}'  # latin-1, not UTF-8
    path.write_bytes(b"\n".join(lines) + b"\n")
    task = JsonlTask(path, num_eval=2)
    assert task.num_train + task.num_eval == 29
    assert task.skipped == [f"{path}:21: not valid UTF-8 (byte 16: invalid continuation byte)"]


def test_custom_fields_and_numeric_answers(tmp_path: Path) -> None:
    records = [{"question": f"q{i}", "target": v} for i, v in enumerate([16, 16.0, 2.5, -3, "seven", 1e20])]
    path = _write(tmp_path / "custom.jsonl", records)
    task = JsonlTask(path, prompt_field="question", answer_field="target", num_eval=0)
    answers = {e.prompt: e.answer for e in itertools.islice(task.train_examples(), 6)}
    assert answers == {"q0": "16", "q1": "16", "q2": "2.5", "q3": "-3", "q4": "seven", "q5": str(10**20)}
    with pytest.raises(DatasetError, match="missing field 'prompt'"):
        JsonlTask(path)


def test_too_few_examples_for_eval(tmp_path: Path) -> None:
    with pytest.raises(DatasetError, match="num_eval"):
        JsonlTask(_dataset(tmp_path, 5), num_eval=5)
    with pytest.raises(DatasetError, match="empty"):
        JsonlTask(_write(tmp_path / "empty.jsonl", [""]))


def test_epochs_and_resume(tmp_path: Path) -> None:
    path = _dataset(tmp_path, 12)
    task = JsonlTask(path, num_eval=2, seed=5)
    it = task.train_examples()
    first_epoch = [next(it).prompt for _ in range(10)]
    second_epoch = [next(it).prompt for _ in range(10)]
    assert sorted(first_epoch) == sorted(second_epoch) and first_epoch != second_epoch

    for _ in range(3):
        next(it)
    state = json.loads(json.dumps(task.state_dict()))
    assert (state["epoch"], state["index"]) == (2, 3)
    expected = [next(it).prompt for _ in range(15)]  # crosses into epoch 3

    resumed = JsonlTask(path, num_eval=2, seed=5)
    resumed.load_state_dict(state)
    assert [e.prompt for e in itertools.islice(resumed.train_examples(5), 15)] == expected

    other = JsonlTask(path, num_eval=2, seed=5)
    restarted = [e.prompt for e in itertools.islice(other.train_examples(6), 10)]
    assert sorted(restarted) == sorted(first_epoch)  # another seed: another order of the same examples

    changed = JsonlTask(_dataset(tmp_path, 13), num_eval=2, seed=5)  # the file grew
    with pytest.raises(ValueError, match="training data differs"):
        changed.load_state_dict(state)
