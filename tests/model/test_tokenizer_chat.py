"""A checkpoint's chat template gives the same token ids here as in transformers, special tokens and stop ids
come from the checkpoint's files, and a tokenizer the model cannot embed is refused by name. The tokenizers and
templates (Qwen style: <|im_start|> turns; Llama 3 style: a {{ bos_token }} prefix and header tokens) are made
here."""

import json
from dataclasses import replace

import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers

from exactrl.model.loading import load_policy
from exactrl.model.tokenizer import Tokenizer, _byte_of
from exactrl.tasks.chat import encode_chat

transformers = pytest.importorskip("transformers")

QWEN_STYLE = (
    "{% if messages[0]['role'] != 'system' %}<|im_start|>system\nYou answer briefly.<|im_end|>\n{% endif %}"
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
LLAMA_STYLE = (
    "{{- bos_token }}{% for m in messages %}"
    "{{ '<|start_header_id|>' + m['role'] + '<|end_header_id|>\n\n' + m['content'] | trim + '<|eot_id|>' }}"
    "{% endfor %}{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
STYLES = {
    "qwen": (
        ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"},
        QWEN_STYLE,
        ["<|im_end|>", "<|endoftext|>"],
    ),
    "llama": (
        ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"],
        {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"},
        LLAMA_STYLE,
        ["<|end_of_text|>", "<|eot_id|>"],
    ),
}

MESSAGES = [
    {"role": "system", "content": "You are terse.\n\nVery terse."},
    {"role": "user", "content": "  What is 12+7?  "},
    {"role": "assistant", "content": "19"},
    {"role": "user", "content": "And héllo <|im_end|> wörld?"},
]


def _write_checkpoint_tokenizer(d, style: str) -> None:
    """A byte-level BPE with a few merges (so turn boundaries can merge) plus the style's special tokens,
    a tokenizer_config.json with its template and a generation_config.json naming its stop ids."""
    specials, named, template, stops = STYLES[style]
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet(), key=_byte_of)
    vocab = {ch: i for i, ch in enumerate(alphabet)}
    merges = [("Ċ", "Ċ"), ("1", "2"), ("h", "é"), ("Ġ", "w")]
    for a, b in merges:
        vocab[a + b] = len(vocab)
    tok = HFTokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(specials)
    d.mkdir(parents=True, exist_ok=True)
    tok.save(str(d / "tokenizer.json"))
    cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "chat_template": template, **named}
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    gen = {"eos_token_id": [tok.token_to_id(t) for t in stops]}
    (d / "generation_config.json").write_text(json.dumps(gen))


@pytest.mark.parametrize("style", ["qwen", "llama"])
@pytest.mark.parametrize("upto", [1, 2, 3, 4])
@pytest.mark.parametrize("gen_prompt", [True, False])
def test_chat_template_ids_match_transformers(tmp_path, style, upto, gen_prompt):
    _write_checkpoint_tokenizer(tmp_path, style)
    ours = Tokenizer.load(tmp_path)
    hf = transformers.AutoTokenizer.from_pretrained(tmp_path)
    msgs = MESSAGES[:upto] if upto > 1 else MESSAGES[1:2]
    want = hf.apply_chat_template(msgs, add_generation_prompt=gen_prompt, tokenize=True, return_dict=False)
    got = encode_chat(ours, msgs, add_generation_prompt=gen_prompt)
    assert got == list(want)
    if style == "llama":
        assert got[0] == ours.bos_token_id == hf.bos_token_id  # the template's {{ bos_token }}


@pytest.mark.parametrize("style", ["qwen", "llama"])
def test_special_and_stop_ids_come_from_the_checkpoint(tmp_path, style):
    _write_checkpoint_tokenizer(tmp_path, style)
    ours = Tokenizer.load(tmp_path)
    hf = transformers.AutoTokenizer.from_pretrained(tmp_path)
    gen = transformers.GenerationConfig.from_pretrained(tmp_path)
    assert ours.eos_token_id == hf.eos_token_id
    assert ours.bos_token_id == hf.bos_token_id
    assert ours.special_tokens == hf.special_tokens_map
    assert ours.stop_token_ids == sorted(set(gen.eos_token_id) | {hf.eos_token_id})
    # Saving keeps them (and adds a pad token when there was none, for transformers' generate).
    ours.save(tmp_path / "again")
    again = Tokenizer.load(tmp_path / "again")
    assert {k: v for k, v in again.special_tokens.items() if k != "pad_token"} == {
        k: v for k, v in ours.special_tokens.items() if k != "pad_token"
    }


def test_special_token_missing_from_vocab_is_named(tmp_path):
    _write_checkpoint_tokenizer(tmp_path, "llama")
    cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    cfg["bos_token"] = "<s>"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    with pytest.raises(
        ValueError, match=r"tokenizer_config.json: bos_token '<s>' is not in .*tokenizer.json"
    ):
        Tokenizer.load(tmp_path)


def test_tokenizer_larger_than_model_vocab_is_refused(tmp_path, monkeypatch):
    import exactrl.model.config as mc
    from exactrl.model.config import preset
    from exactrl.model.hf import save_model
    from exactrl.model.qwen import build_model

    _write_checkpoint_tokenizer(tmp_path / "tok", "llama")
    n = Tokenizer.load(tmp_path / "tok").vocab_size
    save_model(build_model(preset("tiny-llama", num_layers=1, vocab_size=n - 3)), tmp_path / "ckpt")
    with pytest.raises(
        ValueError,
        match=rf"tokenizer vocab/model vocab mismatch: .*tok\) has {n} tokens but the model .*ckpt\) has vocab_size {n - 3}",
    ):
        load_policy(path=tmp_path / "ckpt", tokenizer_path=tmp_path / "tok")
    monkeypatch.setitem(mc.PRESETS, "tiny", replace(mc.PRESETS["tiny"], vocab_size=200))
    with pytest.raises(ValueError, match=rf"has {n} tokens but the model \(preset tiny\) has vocab_size 200"):
        load_policy(preset_name="tiny", tokenizer_path=tmp_path / "tok")
