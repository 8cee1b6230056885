"""Chat formatting with a Qwen-like Jinja2 template, and loading templates from a model directory."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from exactrl.tasks import ChatTemplateError, load_chat_template, render_messages, render_prompt

# A cut-down version of Qwen2.5's template: default system prompt, im_start/im_end turns, generation prompt.
QWEN_LIKE = (
    "{%- if messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'system' and not loop.first %}{{ raise_exception('system must be first') }}{%- endif %}"
    "{%- if message.role != 'system' %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def test_render_with_template() -> None:
    out = render_prompt("12+7-3=", chat_template=QWEN_LIKE)
    assert out == (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\n12+7-3=<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    out = render_prompt("2+2=", chat_template=QWEN_LIKE, system_prompt="Answer with a number.")
    assert out.startswith("<|im_start|>system\nAnswer with a number.<|im_end|>\n<|im_start|>user\n2+2=")
    no_gen = render_prompt("2+2=", chat_template=QWEN_LIKE, add_generation_prompt=False)
    assert no_gen.endswith("2+2=<|im_end|>\n")


def test_without_template_prompt_is_unchanged() -> None:
    assert render_prompt("12+7-3=", chat_template=None) == "12+7-3="
    assert render_prompt("12+7-3=", chat_template=None, system_prompt="Be brief.") == "Be brief.\n12+7-3="


def test_special_tokens_extras_and_tojson() -> None:
    template = "{{ bos_token }}{{ messages | tojson }}{% if enable_thinking is false %}/no_think{% endif %}"
    out = render_prompt("é", chat_template=template, bos_token="<s>", enable_thinking=False)
    # tojson keeps non-ASCII text and key order, like transformers (Jinja's own tojson would escape and sort).
    assert out == '<s>[{"role": "user", "content": "é"}]/no_think'
    assert render_prompt("x", chat_template="{{ bos_token }}|{{ messages[0].content }}") == "|x"
    gen = "{% for m in messages %}{% generation %}{{ m.content }}{% endgeneration %}{% endfor %}"
    assert render_prompt("hi", chat_template=gen) == "hi"


def test_template_errors_and_sandbox() -> None:
    with pytest.raises(ChatTemplateError, match="system must be first"):
        render_messages(
            [{"role": "user", "content": "a"}, {"role": "system", "content": "b"}], chat_template=QWEN_LIKE
        )
    with pytest.raises(ChatTemplateError, match="does not compile"):
        render_prompt("x", chat_template="{% for %}")
    # The sandbox refuses attribute access that could reach Python internals, and mutation of the messages.
    with pytest.raises(ChatTemplateError):
        render_prompt("x", chat_template="{{ messages.__class__.__mro__ }}")
    with pytest.raises(ChatTemplateError):
        render_prompt("x", chat_template="{{ messages.append(1) }}")


def test_load_chat_template(tmp_path: Path) -> None:
    assert load_chat_template(tmp_path) is None
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": QWEN_LIKE}))
    assert load_chat_template(tmp_path) == QWEN_LIKE

    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps(
            {"chat_template": [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]}
        )
    )
    assert load_chat_template(tmp_path) == "D"
    assert load_chat_template(tmp_path, name="tool_use") == "T"
    with pytest.raises(ChatTemplateError, match="available"):
        load_chat_template(tmp_path, name="missing")

    (tmp_path / "chat_template.jinja").write_text("J")  # the standalone file wins, as in transformers
    assert load_chat_template(tmp_path) == "J"
    with pytest.raises(FileNotFoundError):
        load_chat_template(tmp_path / "absent")
