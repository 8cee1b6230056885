"""Tokenizers through the `tokenizers` library: load a checkpoint's tokenizer.json, or build a byte-level one.

The built tokenizer is a byte-level BPE with no merges (one token per byte) plus Qwen's special tokens, so
tiny models can be made and trained without any download, and transformers loads it as a fast tokenizer.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers

from exactrl.model.files import CheckpointError, read_json

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


# The named special tokens transformers passes to a chat template (its SPECIAL_TOKENS_ATTRIBUTES).
SPECIAL_TOKEN_KEYS = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)


class Tokenizer:
    """A thin wrapper: encode/decode, the special tokens and end-of-sequence ids, the chat template, save/load."""

    def __init__(
        self,
        tok: HFTokenizer,
        eos_token: str | None = None,
        chat_template: str | None = None,
        extra_config: dict | None = None,
        special_tokens: dict[str, str] | None = None,
        stop_token_ids: list[int] | None = None,
    ):
        self.tok = tok
        self.chat_template = chat_template
        self.extra_config = dict(extra_config or {})
        self.eos_token = eos_token
        self.eos_token_id = tok.token_to_id(eos_token) if eos_token else None
        # bos_token, eos_token, pad_token, ...: what a chat template sees, as transformers passes them.
        self.special_tokens = {k: v for k, v in (special_tokens or {}).items() if v is not None}
        if eos_token:
            self.special_tokens["eos_token"] = eos_token
        self.bos_token = self.special_tokens.get("bos_token")
        self.bos_token_id = tok.token_to_id(self.bos_token) if self.bos_token else None
        if stop_token_ids is None:
            # No checkpoint said which ids end generation: Qwen chat models end a turn with <|im_end|>.
            names = (eos_token, "<|im_end|>", "<|endoftext|>")
            stop_token_ids = [i for i in (tok.token_to_id(t) for t in names if t) if i is not None]
        self.stop_token_ids = sorted(
            set(stop_token_ids) | ({self.eos_token_id} if self.eos_token_id is not None else set())
        )

    @property
    def vocab_size(self) -> int:
        return self.tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def save(self, out_dir: str | Path) -> None:
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        self.tok.save(str(out / "tokenizer.json"))
        cfg = dict(self.extra_config)
        cfg.update({"tokenizer_class": cfg.get("tokenizer_class", "PreTrainedTokenizerFast")})
        cfg.update(self.special_tokens)
        if self.eos_token:
            cfg["eos_token"] = self.eos_token
            cfg.setdefault("pad_token", self.eos_token)
        if self.chat_template:
            cfg["chat_template"] = self.chat_template
        (out / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n")

    @staticmethod
    def load(path: str | Path) -> Tokenizer:
        """Load from a directory holding tokenizer.json (+ tokenizer_config.json, special_tokens_map.json,
        generation_config.json) or a tokenizer.json path. Special tokens and end-of-sequence ids come from
        those files, as transformers reads them."""
        p = Path(path)
        tok_file = p / "tokenizer.json" if p.is_dir() else p
        if not tok_file.is_file():
            raise FileNotFoundError(f"no tokenizer.json at {tok_file}")
        try:
            tok = HFTokenizer.from_file(str(tok_file))
        except Exception as e:  # the tokenizers library raises a bare Exception for a bad file
            lines = str(e).strip().splitlines()
            raise CheckpointError(
                f"{tok_file}: not a readable tokenizer.json ({lines[0] if lines else e})"
            ) from None
        d = tok_file.parent
        cfg = _json_object(d / "tokenizer_config.json")
        legacy = _json_object(d / "special_tokens_map.json")
        special = {}
        for key in SPECIAL_TOKEN_KEYS:
            value = cfg.get(key, legacy.get(key))
            if isinstance(value, dict):  # AddedToken dicts
                value = value.get("content")
            if isinstance(value, str):
                special[key] = value
        for key, value in special.items():
            if tok.token_to_id(value) is None:
                raise CheckpointError(f"{d / 'tokenizer_config.json'}: {key} {value!r} is not in {tok_file}")
        template = cfg.get("chat_template")
        if isinstance(template, list):  # named templates: take the default one
            template = next(
                (t["template"] for t in template if t.get("name") == "default"), template[0]["template"]
            )
        jinja = d / "chat_template.jinja"
        if template is None and jinja.is_file():
            template = jinja.read_text(encoding="utf-8")
        eos = special.get("eos_token")
        if eos is None:
            eos = next((t for t in ("<|im_end|>", "<|endoftext|>") if tok.token_to_id(t) is not None), None)
        # Generation stops where the checkpoint says (generation_config.json's eos_token_id, which Llama 3
        # instruct sets to several ids), and at the tokenizer's EOS.
        stop = None
        gen_eos = _json_object(d / "generation_config.json").get("eos_token_id")
        if gen_eos is not None:
            stop = [gen_eos] if isinstance(gen_eos, int) else list(gen_eos)
            bad = [i for i in stop if not isinstance(i, int) or not 0 <= i < tok.get_vocab_size(True)]
            if bad:
                raise CheckpointError(
                    f"{d / 'generation_config.json'}: eos_token_id {bad} outside the tokenizer's "
                    f"{tok.get_vocab_size(True)} ids"
                )
        keep = {k: v for k, v in cfg.items() if k not in ("chat_template", "added_tokens_decoder")}
        return Tokenizer(
            tok,
            eos_token=eos,
            chat_template=template,
            extra_config=keep,
            special_tokens=special,
            stop_token_ids=stop,
        )


def _json_object(path: Path) -> dict:
    if not path.is_file():
        return {}
    d = read_json(path)
    if not isinstance(d, dict):
        raise CheckpointError(f"{path}: expected a JSON object, got {type(d).__name__}")
    return d


def byte_tokenizer(eos_token: str = "<|endoftext|>") -> Tokenizer:
    """Byte-level BPE with no merges: ids 0..255 are bytes (in GPT-2's byte-to-unicode alphabet), then specials."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet, key=_byte_of))}
    tok = HFTokenizer(models.BPE(vocab=vocab, merges=[], fuse_unk=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIAL_TOKENS)
    return Tokenizer(tok, eos_token=eos_token)


def _byte_of(ch: str) -> int:
    """Inverse of GPT-2's bytes_to_unicode, so id i is byte i."""
    bs = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(map(chr, cs), bs))[ch]
