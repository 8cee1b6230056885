"""Tokenizers through the `tokenizers` library: load a checkpoint's tokenizer.json, or build a byte-level one.

The built tokenizer is a byte-level BPE with no merges (one token per byte) plus Qwen's special tokens, so
tiny models can be made and trained without any download, and transformers loads it as a fast tokenizer.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


class Tokenizer:
    """A thin wrapper: encode/decode, the end-of-sequence ids, the chat template, save/load."""

    def __init__(
        self,
        tok: HFTokenizer,
        eos_token: str | None = None,
        chat_template: str | None = None,
        extra_config: dict | None = None,
    ):
        self.tok = tok
        self.chat_template = chat_template
        self.extra_config = dict(extra_config or {})
        self.eos_token = eos_token
        self.eos_token_id = tok.token_to_id(eos_token) if eos_token else None
        # Generation stops on any of these (Qwen chat models end a turn with <|im_end|>).
        self.stop_token_ids = sorted(
            {
                i
                for i in (self.eos_token_id, tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>"))
                if i is not None
            }
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
        if self.eos_token:
            cfg["eos_token"] = self.eos_token
            cfg.setdefault("pad_token", self.eos_token)
        if self.chat_template:
            cfg["chat_template"] = self.chat_template
        (out / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n")

    @staticmethod
    def load(path: str | Path) -> Tokenizer:
        """Load from a directory holding tokenizer.json (+ tokenizer_config.json) or a tokenizer.json path."""
        p = Path(path)
        tok_file = p / "tokenizer.json" if p.is_dir() else p
        if not tok_file.is_file():
            raise FileNotFoundError(f"no tokenizer.json at {tok_file}")
        tok = HFTokenizer.from_file(str(tok_file))
        cfg_file = tok_file.parent / "tokenizer_config.json"
        cfg = json.loads(cfg_file.read_text()) if cfg_file.is_file() else {}
        eos = cfg.get("eos_token")
        if isinstance(eos, dict):  # older configs store AddedToken dicts
            eos = eos.get("content")
        template = cfg.get("chat_template")
        if isinstance(template, list):  # named templates: take the default one
            template = next(
                (t["template"] for t in template if t.get("name") == "default"), template[0]["template"]
            )
        jinja = tok_file.parent / "chat_template.jinja"
        if template is None and jinja.is_file():
            template = jinja.read_text()
        if eos is None:
            eos = next((t for t in ("<|im_end|>", "<|endoftext|>") if tok.token_to_id(t) is not None), None)
        keep = {k: v for k, v in cfg.items() if k not in ("chat_template", "added_tokens_decoder")}
        return Tokenizer(tok, eos_token=eos, chat_template=template, extra_config=keep)


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
