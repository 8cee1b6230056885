"""A learned reward: tiny random-weight *ForSequenceClassification checkpoints built by transformers, scored in
padded batches and compared with transformers' own forward of one sample at a time."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

transformers = pytest.importorskip("transformers")

from exactrl.model.tokenizer import byte_tokenizer  # noqa: E402
from exactrl.tasks import Example, RewardComputer  # noqa: E402
from exactrl.tasks.reward_model import RewardModel  # noqa: E402

CHAT = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _save_rm(path: Path, arch: str, *, num_labels: int = 3, pad: bool = True, chat: bool = True) -> Path:
    common = dict(
        vocab_size=300,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        num_labels=num_labels,
    )
    torch.manual_seed(0)
    if arch == "qwen3":
        model = transformers.Qwen3ForSequenceClassification(transformers.Qwen3Config(head_dim=16, **common))
    elif arch == "qwen2":
        model = transformers.Qwen2ForSequenceClassification(transformers.Qwen2Config(**common))
    else:
        model = transformers.LlamaForSequenceClassification(transformers.LlamaConfig(**common))
    with torch.no_grad():  # a zero-initialised head would score everything alike
        model.score.weight.normal_(0, 0.5)
    tok = transformers.PreTrainedTokenizerFast(
        tokenizer_object=byte_tokenizer().tok,
        eos_token="<|endoftext|>",
        pad_token="<|endoftext|>" if pad else None,
    )
    model.config.pad_token_id = tok.pad_token_id if pad else None
    if chat:
        tok.chat_template = CHAT
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


SAMPLES = [
    ("What is 2+2?", "4"),
    ("Name a colour.", "A long answer that goes on for a while, so that the batch needs padding: blue."),
    ("Say hi", ""),
    ("x" * 40, "yes"),
    ("Chat prompt", "ok"),
]


def _examples() -> list[Example]:
    exs = [Example(prompt=p, answer="", meta={}) for p, _ in SAMPLES]
    exs[-1] = Example(
        prompt=[{"role": "system", "content": "Be kind."}, {"role": "user", "content": "hi"}], answer=""
    )
    return exs


@pytest.mark.parametrize(
    "arch,pad,chat", [("qwen3", True, True), ("qwen2", False, True), ("llama", True, False)]
)
def test_batched_scores_match_transformers_one_at_a_time(
    tmp_path: Path, arch: str, pad: bool, chat: bool
) -> None:
    path = _save_rm(tmp_path / arch, arch, pad=pad, chat=chat)
    rm = RewardModel(path, label=1, batch_size=4)  # 5 samples: a full batch and a partial one, both padded
    completions = [c for _, c in SAMPLES]
    examples = _examples()
    scores = rm(completions, [""] * len(SAMPLES), examples)

    hf = transformers.AutoModelForSequenceClassification.from_pretrained(path).eval()
    hf_tok = transformers.AutoTokenizer.from_pretrained(path)
    expected = []
    for c, ex in zip(completions, examples):
        if chat:
            msgs = [{"role": "user", "content": ex.prompt}] if isinstance(ex.prompt, str) else list(ex.prompt)
            text = hf_tok.apply_chat_template([*msgs, {"role": "assistant", "content": c}], tokenize=False)
        else:
            prompt = ex.prompt if isinstance(ex.prompt, str) else "\n".join(m["content"] for m in ex.prompt)
            text = prompt + c
        ids = torch.tensor([hf_tok(text)["input_ids"]])
        with torch.no_grad():
            expected.append(float(hf(input_ids=ids).logits[0, 1]))
    torch.testing.assert_close(torch.tensor(scores), torch.tensor(expected), rtol=1e-5, atol=1e-5)
    assert len(set(scores)) == len(scores)  # the samples really score differently
    # Another label is another score: the label is honoured.
    other = RewardModel(path, label=2, batch_size=4)(completions, [""] * len(SAMPLES), examples)
    assert all(abs(a - b) > 1e-6 for a, b in zip(scores, other))


def test_reward_model_in_the_computer_and_refusals(tmp_path: Path) -> None:
    path = _save_rm(tmp_path / "rm", "qwen3", num_labels=1)
    cfg = SimpleNamespace(
        functions=["exact_match"],
        weights=[],
        timeout_s=5.0,
        model="rm",  # relative to the config's directory
        model_dtype="float32",
        model_label=0,
        model_batch_size=2,
        model_max_tokens=4096,
        model_weight=0.5,
    )
    examples = _examples()[:3]
    with RewardComputer.from_config(cfg, device="cpu", base_dir=tmp_path) as rc:
        res = rc(["4", "blue", ""], ["4", "red", "x"], examples)
        # The model's score is a preference, not a verdict: accuracy stays the listed correctness function's.
        assert rc.accuracy_fn == "exact_match" and res.correct == [True, False, False]
    rm_scores = RewardModel(path)(["4", "blue", ""], ["", "", ""], examples)
    assert res.per_function["reward_model"] == pytest.approx(rm_scores, abs=1e-5)
    assert res.rewards == pytest.approx(
        [1 + 0.5 * rm_scores[0], 0.5 * rm_scores[1], 0.5 * rm_scores[2]], abs=1e-5
    )

    with pytest.raises(ValueError, match=r"reward.model_label = 1, but .* has 1 labels"):
        RewardModel(path, label=1)
    causal = tmp_path / "causal"
    transformers.Qwen3ForCausalLM(
        transformers.Qwen3Config(
            vocab_size=300,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=16,
        )
    ).save_pretrained(causal)
    with pytest.raises(ValueError, match=r"Qwen3ForCausalLM.*supported: \*ForSequenceClassification"):
        RewardModel(causal)
    with pytest.raises(FileNotFoundError, match="no config.json"):
        RewardModel(tmp_path / "nowhere")
