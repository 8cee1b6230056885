"""Chat formatting of plain-string prompts with a Hugging Face style Jinja2 chat template.

Rendering follows what `transformers` does (`trim_blocks`/`lstrip_blocks`, `loopcontrols`, a `tojson` filter
that keeps non-ASCII text, `raise_exception` and `strftime_now` globals, a no-op `{% generation %}` block) so that
a template copied from a model's `tokenizer_config.json` gives the same text here as there. Templates come from
model repositories, i.e. from strangers: they run in Jinja2's immutable sandbox.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment


class ChatTemplateError(ValueError):
    """A chat template failed to compile or to render (including its own `raise_exception` calls)."""


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: Any = None,
    sort_keys: bool = False,
) -> str:
    # Same defaults as transformers: Jinja's own `tojson` HTML-escapes and sorts keys, which changes the prompt.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _GenerationBlock(Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for masks in transformers; here it only renders
    its body, so templates that use it still compile."""

    tags = {"generation"}

    def parse(self, parser: Any) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_render_body"), [], [], body).set_lineno(lineno)

    def _render_body(self, caller: Any) -> str:
        return caller()


@functools.lru_cache(maxsize=16)
def _compile(chat_template: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationBlock, "jinja2.ext.loopcontrols"]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(chat_template)
    except jinja2.TemplateSyntaxError as e:
        raise ChatTemplateError(
            f"chat template does not compile: {e.message} (template line {e.lineno})"
        ) from e


def render_messages(
    messages: Sequence[Mapping[str, Any]],
    *,
    chat_template: str,
    add_generation_prompt: bool = True,
    bos_token: str | None = None,
    eos_token: str | None = None,
    **template_kwargs: Any,
) -> str:
    """Render a list of `{"role", "content"}` messages with a chat template.

    `template_kwargs` are passed to the template as variables (e.g. `enable_thinking=False` for Qwen3 templates).
    `bos_token`/`eos_token` are only defined when given; templates treat a missing one as the empty string.
    """
    template = _compile(chat_template)
    variables: dict[str, Any] = dict(template_kwargs)
    variables["messages"] = [dict(m) for m in messages]
    variables["add_generation_prompt"] = add_generation_prompt
    if bos_token is not None:
        variables["bos_token"] = bos_token
    if eos_token is not None:
        variables["eos_token"] = eos_token
    try:
        return template.render(**variables)
    except jinja2.TemplateError as e:
        raise ChatTemplateError(f"chat template failed to render: {e}") from e


def encode_chat(
    tokenizer: Any,
    messages: Sequence[Mapping[str, Any]],
    *,
    add_generation_prompt: bool = True,
    **template_kwargs: Any,
) -> list[int]:
    """Token ids of `messages` with the tokenizer's chat template, as transformers'
    `apply_chat_template(..., tokenize=True)` makes them: the tokenizer's named special tokens (`bos_token`,
    `eos_token`, ...: `exactrl.model.tokenizer.Tokenizer.special_tokens`) are template variables, since a Llama 3
    template opens with `{{ bos_token }}`, and the text is encoded without adding special tokens again."""
    if tokenizer.chat_template is None:
        raise ChatTemplateError(
            "the tokenizer has no chat template (tokenizer_config.json / chat_template.jinja)"
        )
    text = render_messages(
        messages,
        chat_template=tokenizer.chat_template,
        add_generation_prompt=add_generation_prompt,
        **{**tokenizer.special_tokens, **template_kwargs},
    )
    return tokenizer.encode(text)


def render_prompt(
    prompt: str | Sequence[Mapping[str, Any]],
    *,
    chat_template: str | None,
    system_prompt: str | None = None,
    add_generation_prompt: bool = True,
    bos_token: str | None = None,
    eos_token: str | None = None,
    **template_kwargs: Any,
) -> str:
    """The model input for a task prompt.

    With a template: renders `[{"role": "system", ...}?, {"role": "user", "content": prompt}]`; a prompt that is
    already a list of messages is rendered as it is, after the system prompt unless it has a system message.
    Without one (base models): the prompt unchanged, or `system_prompt + "\\n" + prompt` if a system prompt is given.
    BOS is not added in that case: adding special tokens is the tokenizer's job. A chat without a template is
    refused: there is no neutral way to flatten it.
    """
    if not isinstance(prompt, str):
        if chat_template is None:
            raise ChatTemplateError(
                "this prompt is a list of chat messages but no chat template is in use (the tokenizer has none, or "
                "task.use_chat_template = false): use a model with a chat template, or give prompts as strings"
            )
        messages = [dict(m) for m in prompt]
        if system_prompt is not None and not (messages and messages[0].get("role") == "system"):
            messages.insert(0, {"role": "system", "content": system_prompt})
        return render_messages(
            messages,
            chat_template=chat_template,
            add_generation_prompt=add_generation_prompt,
            bos_token=bos_token,
            eos_token=eos_token,
            **template_kwargs,
        )
    if chat_template is None:
        return prompt if system_prompt is None else f"{system_prompt}\n{prompt}"
    messages = []
    if system_prompt is not None:
        messages.append({"role": "system", "content": system_prompt})
    messages.append({"role": "user", "content": prompt})
    return render_messages(
        messages,
        chat_template=chat_template,
        add_generation_prompt=add_generation_prompt,
        bos_token=bos_token,
        eos_token=eos_token,
        **template_kwargs,
    )


def load_chat_template(model_dir: str | Path, name: str | None = None) -> str | None:
    """The chat template of a model directory, or None if it has none.

    Looked up in the order transformers prefers: a `chat_template.jinja` file, then `chat_template.json`
    (processor style), then the `chat_template` key of `tokenizer_config.json`. That key may be a string or a list
    of `{"name", "template"}`; from a list, `name` picks one, else the one named "default", else the only one.
    """
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise FileNotFoundError(f"model directory not found: {model_dir}")
    jinja_file = model_dir / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    for filename in ("chat_template.json", "tokenizer_config.json"):
        path = model_dir / filename
        if not path.is_file():
            continue
        try:
            config = json.loads(path.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ChatTemplateError(f"{path}: not valid JSON ({e})") from e
        template = config.get("chat_template") if isinstance(config, dict) else None
        if template is not None:
            return _pick_template(template, name, path)
    return None


def _pick_template(template: Any, name: str | None, path: Path) -> str:
    if isinstance(template, str):
        return template
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        if name is not None:
            chosen = named.get(name)
        elif "default" in named:
            chosen = named["default"]
        elif len(named) == 1:
            chosen = next(iter(named.values()))
        else:
            chosen = None
        if isinstance(chosen, str):
            return chosen
        wanted = repr(name) if name is not None else "'default' (or a single template)"
        raise ChatTemplateError(
            f"{path}: no chat template named {wanted}; available: {sorted(map(str, named))}"
        )
    raise ChatTemplateError(
        f"{path}: chat_template must be a string or a list, got {type(template).__name__}"
    )
