"""Tokenizer and chat template, built from a GGUF file's ``tokenizer.*`` metadata.

Behaviour follows llama.cpp (src/llama-vocab.cpp), the oracle we test against:

    text --special-token partition--> fragments (raw text | special token id)
         --per raw fragment----------> pre-tokenizer regexes (chosen by tokenizer.ggml.pre)
         --per word------------------> BPE merges by rank (gpt2) | score-based merges (llama SPM)
         --> ids, with BOS/EOS added per tokenizer.ggml.add_{bos,eos}_token

- ``tokenizer.ggml.model == "gpt2"``: byte-level BPE. The pre-tokenizer regexes of
  llama.cpp's ``llm_tokenizer_bpe`` are applied in sequence (each one splits the pieces the
  previous one produced, matches and the text between them both kept: HF's "isolated"
  split), then GPT-2 byte-to-unicode mapping, then the HF ``tokenizers`` BPE model with the
  file's vocabulary and merges (``ignore_merges`` where llama.cpp sets it).
- ``tokenizer.ggml.model == "llama"``: SentencePiece-style merges by token score with
  ``<0xXX>`` byte fallback, spaces escaped as U+2581 and a space prefix after BOS/specials:
  a small faithful port of llama.cpp's ``llm_tokenizer_spm_session`` (HF's BPE model merges
  by rank, not by score, so it cannot reproduce this).
- Special tokens: control (type 3) and unknown (type 2) tokens are matched as single tokens
  only when ``parse_special`` is set (chat prompts); user-defined tokens (type 4) always, as
  llama.cpp does. Longest token text first, as llama.cpp's ``tokenizer_st_partition``.
- Decoding is llama.cpp's ``token_to_piece``: byte-level tokens back to bytes, control tokens
  empty unless ``special=True``; :class:`IncrementalDetokenizer` yields only complete UTF-8.
- Chat templates (``tokenizer.chat_template``) render with a sandboxed jinja2 environment the
  way HF transformers does (trim_blocks, lstrip_blocks, loopcontrols, ``raise_exception``,
  ``tojson``, ``strftime_now``).

One deliberate difference from llama.cpp: when the text (e.g. a rendered chat template)
already starts with the BOS token, :meth:`Tokenizer.encode` does not add a second one
(llama.cpp adds it and warns about the double BOS).
"""

from __future__ import annotations

import codecs
import datetime
import heapq
import json
import threading
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from moe_service.errors import ModelFileError
from moe_service.log import get_logger

log = get_logger(__name__)

# llama.cpp's llama_token_type (GGUF tokenizer.ggml.token_type values)
TOKEN_TYPE_UNDEFINED = 0
TOKEN_TYPE_NORMAL = 1
TOKEN_TYPE_UNKNOWN = 2
TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4
TOKEN_TYPE_UNUSED = 5
TOKEN_TYPE_BYTE = 6

# llama.cpp's llama_token_attr bit flags (what a token type becomes at load time)
ATTR_UNDEFINED = 0
ATTR_UNKNOWN = 1 << 0
ATTR_UNUSED = 1 << 1
ATTR_NORMAL = 1 << 2
ATTR_CONTROL = 1 << 3
ATTR_USER_DEFINED = 1 << 4
ATTR_BYTE = 1 << 5

_TYPE_TO_ATTR = {
    TOKEN_TYPE_UNKNOWN: ATTR_UNKNOWN,
    TOKEN_TYPE_UNUSED: ATTR_UNUSED,
    TOKEN_TYPE_NORMAL: ATTR_NORMAL,
    TOKEN_TYPE_CONTROL: ATTR_CONTROL,
    TOKEN_TYPE_USER_DEFINED: ATTR_USER_DEFINED,
    TOKEN_TYPE_BYTE: ATTR_BYTE,
    TOKEN_TYPE_UNDEFINED: ATTR_UNDEFINED,
}

SPM_SPACE = "\u2581"  # "▁", SentencePiece's escaped space

# --------------------------------------------------------------------------------------------
# Pre-tokenizer regexes, as llama.cpp's llm_tokenizer_bpe constructor lists them per pre-type.
# Each tuple is applied in order; llama.cpp's std::regex-friendly spellings are kept
# (e.g. (?:'[sS]|...) for (?i:'s|...)), which Oniguruma (HF tokenizers) reads the same way.
# --------------------------------------------------------------------------------------------
_CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3 = (
    _CONTRACTIONS
    + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2 = _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_QWEN35 = (
    _CONTRACTIONS
    + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT4O = (
    r"[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))*((?=[\p{L}])([^A-Z]))+" + _CONTRACTIONS + "?"
    r"|[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))+((?=[\p{L}])([^A-Z]))*" + _CONTRACTIONS + "?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_TEKKEN = (
    r"[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))*((?=[\p{L}])([^A-Z]))+"
    r"|[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))+((?=[\p{L}])([^A-Z]))*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_DEEPSEEK3_MAIN = (
    r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
    r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_CJK_KANA = "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+"
_DEEPSEEK_LLM_LETTERS = (
    "\\s?[A-Za-z\u00b5\u00c0-\u00d6\u00d8-\u00f6\u00f8-\u01ba\u01bc-\u01bf\u01c4-\u0293\u0295-\u02af"
    "\u0370-\u0373\u0376\u0377\u037b-\u037d\u037f\u0386\u0388-\u038a\u038c\u038e-\u03a1\u03a3-\u03f5"
    "\u03f7-\u0481\u048a-\u052f\u0531-\u0556\u10a0-\u10c5\u13a0-\u13f5\u13f8-\u13fd\u1c90-\u1cba"
    "\u1cbd-\u1cbf\u1d00-\u1d2b\u1d6b-\u1d77\u1d79-\u1d9a\u1e00-\u1f15\u1f18-\u1f1d\u1f20-\u1f45"
    "\u1f48-\u1f4d\u1f50-\u1f57\u1f59\u1f5b\u1f5d\u1f5f-\u1f7d\u1f80-\u1fb4\u1fb6-\u1fbc\u1fbe"
    "\u1fc2-\u1fc4\u1fc6-\u1fcc\u1fd0-\u1fd3\u1fd6-\u1fdb\u1fe0-\u1fec\u1ff2-\u1ff4\u1ff6-\u1ffc"
    "\u2102\u2107\u210a-\u2113\u2115\u2119-\u211d\u2124\u2126\u2128\u212a-\u212d\u212f-\u2134\u2139"
    "\u213c-\u213f\u2145-\u2149\u214e\u2183\u2184\u2c00-\u2c7b\u2c7e-\u2ce4\u2ceb-\u2cee\u2cf2\u2cf3"
    "\ua640-\ua66d\ua680-\ua69b\ua722-\ua76f\ua771-\ua787\ua78b-\ua78e\uab70-\uabbf\ufb00-\ufb06"
    "\ufb13-\ufb17\uff21-\uff3a\uff41-\uff5a\U00010400-\U0001044f\U000104b0-\U000104d3"
    "\U000104d8-\U000104fb\U00010c80-\U00010cb2\U00010cc0-\U00010cf2\U000118a0-\U000118df"
    "\U0001e900-\U0001e943]+"
)
_FALCON = (r"[\p{P}\$\+<=>\^~\|`]+", _GPT2, r"[0-9][0-9][0-9]")
_STARCODER = (r"\p{N}", _GPT2)
_DEFAULT = (r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", r"[0-9][0-9][0-9]")

PRE_TOKENIZER_REGEXES: dict[str, tuple[str, ...]] = {
    "default": _DEFAULT,
    "llama3": (_LLAMA3,),
    "dbrx": (_LLAMA3,),
    "deepseek-llm": (
        "[\r\n]",
        _DEEPSEEK_LLM_LETTERS,
        "\\s?[!-/:-~\uff01-\uff0f\uff1a-\uff5e\u2018-\u201f\u3000-\u3002]+",
        r"\s+$",
        "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+",
        r"\p{N}+",
    ),
    "deepseek-coder": (
        "[\r\n]",
        r"\s?\p{L}+",
        r"\s?\p{P}+",
        "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+",
        r"\p{N}",
    ),
    "deepseek-v3": (r"\p{N}{1,3}", _CJK_KANA, _DEEPSEEK3_MAIN),
    "falcon": _FALCON,
    "starcoder": _STARCODER,
    "gpt2": (_GPT2,),
    "qwen2": (_QWEN2,),
    "qwen35": (_QWEN35,),
    "chatglm4": (_LLAMA3,),
    "gpt-4o": (_GPT4O,),
    "tekken": (_TEKKEN,),
    "bloom": (" ?[^(\\s|.,!?\u2026\u3002\uff0c\u3001\u0964\u06d4\u060c)]+",),
    "viking": (" ?[^(\\s|.,!?\u2026\u3002\uff0c\u3001\u0964\u06d4\u060c)]+", r"\p{N}"),
}


@dataclass(frozen=True)
class PreTokenizerRule:
    """How llama.cpp treats one ``tokenizer.ggml.pre`` value (llama-vocab.cpp, ``load``)."""

    regex_key: str
    ignore_merges: bool = False
    add_bos_default: bool = False


def _rules() -> dict[str, PreTokenizerRule]:
    table: dict[str, PreTokenizerRule] = {}

    def add(names: Iterable[str], key: str, **kw: bool) -> None:
        for name in names:
            table[name] = PreTokenizerRule(key, **kw)

    add(["default"], "default")
    add(["llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2",
         "jina-v5-nano"], "llama3", ignore_merges=True, add_bos_default=True)
    add(["dbrx", "smaug-bpe"], "dbrx")
    add(["deepseek-llm"], "deepseek-llm")
    add(["deepseek-coder"], "deepseek-coder")
    add(["deepseek-v3", "hunyuan-dense", "joyai-llm", "hy_v4"], "deepseek-v3")
    add(["falcon"], "falcon")
    add(["starcoder", "refact", "command-r", "smollm", "codeshell", "exaone", "minerva-7b", "mellum2"],
        "starcoder")
    add(["gpt-2", "phi-2", "jina-es", "jina-de", "gigachat", "jina-v2-es", "jina-v2-de", "a.x-4.0",
         "mellum", "modern-bert", "jina-v1-en", "jina-v2-code", "roberta-bpe", "mpt", "olmo", "jais",
         "exaone4", "trillion", "granite-docling"], "gpt2")
    add(["qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "stablelm2", "hunyuan", "megrez", "solar-open"],
        "qwen2")
    add(["qwen35"], "qwen35")
    add(["chatglm-bpe"], "chatglm4")
    add(["glm4", "glm5"], "chatglm4", ignore_merges=True)
    add(["gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"], "gpt-4o")
    add(["tekken"], "tekken", ignore_merges=True, add_bos_default=True)
    add(["bloom", "gpt3-finnish", "poro-chat"], "bloom")
    add(["viking"], "viking")
    return table


PRE_TOKENIZER_RULES: dict[str, PreTokenizerRule] = _rules()

# Token texts llama.cpp treats as end-of-generation (and forces to CONTROL), llama-vocab.cpp.
_EOG_TEXTS = frozenset({
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>",
    "<end_of_turn>", "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]",
    "<|end_of_text|>", "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>",
    "<\uff5cend\u2581of\u2581sentence\uff5c>", "[e~[",
})
_EOT_TEXTS = frozenset({
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|end_of_text|>",
    "<EOT>", "_<EOT>", "[EOT]", "<\uff5cend\u2581of\u2581sentence\uff5c>", "<end_of_utterance>",
})
# gpt-oss (o200k_harmony): llama.cpp renders these as text (USER_DEFINED).
_ALWAYS_RENDERED_TEXTS = frozenset({"<|channel|>", "<|message|>", "<|start|>", "<|constrain|>"})


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map (256 entries), as llama.cpp's unicode.cpp."""
    bs = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("\xa1"), ord("\xac") + 1))
          + list(range(ord("\xae"), ord("\xff") + 1)))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs, strict=True)}


_BYTE_TO_CHAR = bytes_to_unicode()
_CHAR_TO_BYTE = {c: b for b, c in _BYTE_TO_CHAR.items()}


def _decode_byte_level(text: str) -> bytes:
    """llama.cpp's llama_decode_text: byte-level token text back to raw bytes."""
    out = bytearray()
    for ch in text:
        b = _CHAR_TO_BYTE.get(ch)
        if b is None:  # not a byte-level character: llama.cpp writes [UNK_BYTE_0x..] + text
            out += b"[UNK_BYTE_0x" + ch.encode("utf-8").hex().encode() + text.encode("utf-8") + b"]"
        else:
            out.append(b)
    return bytes(out)


def builtin_chat_template(metadata: Mapping[str, Any], vocab: Mapping[str, int], source: str) -> str | None:
    """The chat template for a file that carries none, when its architecture and vocabulary
    name the format (as llama.cpp falls back to built-in formats): ``deepseek4`` with
    DeepSeek's ``<｜User｜>`` / ``<｜Assistant｜>`` tokens renders the DeepSeek V4 format
    (moe_service/deepseek4_template.jinja). None otherwise (chat requests then fail naming the
    missing tokenizer.chat_template)."""
    arch = metadata.get("general.architecture")
    if arch == "deepseek4" and "<｜User｜>" in vocab and "<｜Assistant｜>" in vocab:
        from importlib import resources

        log.info("chat_template_builtin", source=source, arch=arch, template="deepseek4_template.jinja",
                 why="the file has no tokenizer.chat_template")
        return resources.files("moe_service").joinpath("deepseek4_template.jinja").read_text(encoding="utf-8")
    return None


def _meta(metadata: Mapping[str, Any], key: str, default: Any = None) -> Any:
    value = metadata.get(key, default)
    return default if value is None else value


class Tokenizer:
    """A GGUF model's tokenizer: text <-> token ids, as llama.cpp tokenizes.

    Build it with :meth:`from_gguf` (metadata dict) or :meth:`from_file` (a .gguf path).

    Attributes:
        model: ``"gpt2"`` (byte-level BPE) or ``"llama"`` (SentencePiece-style).
        pre: the ``tokenizer.ggml.pre`` value (``"default"`` when absent).
        tokens: token id -> token text (``list[str]``, length ``n_vocab``).
        attrs: token id -> llama.cpp attribute bit flags (``ATTR_*``).
        bos_id, eos_id, eot_id, unk_id, pad_id: special ids (``None`` when the model has none).
        eog_ids: ids that end generation (EOS, EOT, EOM and the texts llama.cpp recognises).
        add_bos, add_eos: whether :meth:`encode` adds BOS/EOS when ``add_special`` is set.
        chat_template: the ``tokenizer.chat_template`` source, or ``None``.
    """

    def __init__(self, metadata: Mapping[str, Any], *, source: str = "<metadata>"):
        self.source = source
        self.model = str(_meta(metadata, "tokenizer.ggml.model", ""))
        tokens = _meta(metadata, "tokenizer.ggml.tokens")
        if not tokens:
            raise ModelFileError(f"{source}: tokenizer.ggml.tokens is missing or empty.")
        self.tokens: list[str] = [str(t) for t in tokens]
        n_vocab = len(self.tokens)
        types = list(_meta(metadata, "tokenizer.ggml.token_type", [TOKEN_TYPE_NORMAL] * n_vocab))
        if len(types) < n_vocab:
            raise ModelFileError(
                f"{source}: tokenizer.ggml.token_type has {len(types)} entries for {n_vocab} tokens.")
        scores = _meta(metadata, "tokenizer.ggml.scores")
        self.scores: list[float] = [float(s) for s in scores] if scores is not None else [0.0] * n_vocab
        if len(self.scores) < n_vocab:
            raise ModelFileError(
                f"{source}: tokenizer.ggml.scores has {len(self.scores)} entries for {n_vocab} tokens.")
        for i, t in enumerate(self.tokens):
            if "\0" in t:  # llama.cpp reads token texts as C strings: they end at a NUL
                t = self.tokens[i] = t.split("\0", 1)[0]
            if not t:  # llama.cpp renames empty tokens
                self.tokens[i] = f"[EMPTY_{i}]"
        self.token_to_id: dict[str, int] = {t: i for i, t in enumerate(self.tokens)}
        self.attrs: list[int] = [_TYPE_TO_ATTR.get(int(t), ATTR_UNDEFINED) for t in types[:n_vocab]]
        self.token_types: list[int] = [int(t) for t in types[:n_vocab]]
        self.chat_template: str | None = (_meta(metadata, "tokenizer.chat_template")
                                          or builtin_chat_template(metadata, self.token_to_id, source))

        if self.model == "gpt2":
            self.pre = str(_meta(metadata, "tokenizer.ggml.pre", "")) or "default"
            rule = PRE_TOKENIZER_RULES.get(self.pre)
            if rule is None:
                raise ModelFileError(
                    f"{source}: tokenizer.ggml.pre = {self.pre!r} is not a pre-tokenizer this tokenizer knows "
                    f"(known: {', '.join(sorted(PRE_TOKENIZER_RULES))}).")
            self.pre_rule = rule
            self.regexes = PRE_TOKENIZER_REGEXES[rule.regex_key]
            add_bos_default, add_space_prefix_default = rule.add_bos_default, False
            bos_default, eos_default, unk_default, pad_default = 11, 11, None, None
        elif self.model == "llama":
            self.pre = "default"
            self.pre_rule = PreTokenizerRule("default")
            self.regexes = ()
            add_bos_default, add_space_prefix_default = True, True
            bos_default, eos_default, unk_default, pad_default = 1, 2, 0, None
        else:
            raise ModelFileError(
                f"{source}: tokenizer.ggml.model = {self.model!r} is not supported "
                "(supported: 'gpt2' byte-level BPE, 'llama' SentencePiece).")

        def special(key: str, default: int | None) -> int | None:
            value = metadata.get(f"tokenizer.ggml.{key}")
            if value is not None and 0 <= int(value) < n_vocab:
                return int(value)
            return default if default is not None and default < n_vocab else None

        self.bos_id = special("bos_token_id", bos_default)
        self.eos_id = special("eos_token_id", eos_default)
        self.unk_id = special("unknown_token_id", unk_default)
        self.pad_id = special("padding_token_id", pad_default)
        self.eot_id = special("eot_token_id", None)
        self.eom_id = special("eom_token_id", None)
        add_bos = metadata.get("tokenizer.ggml.add_bos_token")
        add_eos = metadata.get("tokenizer.ggml.add_eos_token")
        self.add_bos = bool(add_bos) if add_bos is not None else add_bos_default
        self.add_eos = bool(add_eos) if add_eos is not None else False
        add_prefix = metadata.get("tokenizer.ggml.add_space_prefix")
        self.add_space_prefix = bool(add_prefix) if add_prefix is not None else add_space_prefix_default

        self._apply_llama_cpp_attr_fixups()
        # llama.cpp's cache_special_tokens: every control / user-defined / unknown token,
        # longest text first (ties by id, which is what a stable sort of the id order gives).
        special_ids = [i for i, a in enumerate(self.attrs) if a & (ATTR_CONTROL | ATTR_USER_DEFINED | ATTR_UNKNOWN)]
        self._special_ids = sorted(special_ids, key=lambda i: -len(self.tokens[i].encode("utf-8")))
        self._pieces: list[bytes] = [self._piece(i, special=False) for i in range(n_vocab)]
        self._pieces_special: list[bytes] = [self._piece(i, special=True) for i in range(n_vocab)]
        self._hf = self._build_hf_bpe(metadata) if self.model == "gpt2" else None
        self._chat: ChatTemplate | None = None

    # ---------------------------------------------------------------------------------- build
    @classmethod
    def from_gguf(cls, metadata: Mapping[str, Any], *, source: str = "<metadata>") -> Tokenizer:
        """Build from a GGUF metadata dict of plain Python values (``tokenizer.ggml.*`` keys).

        Raises:
            ModelFileError: a key is missing or holds a value llama.cpp would refuse.
        """
        return cls(metadata, source=source)

    @classmethod
    def from_file(cls, path: str | Path) -> Tokenizer:
        """Read ``path``'s metadata with gguf's GGUFReader and build the tokenizer from it."""
        return cls(read_gguf_metadata(path, prefixes=("tokenizer.", "general.")), source=str(path))

    def _apply_llama_cpp_attr_fixups(self) -> None:
        """Attribute overrides llama.cpp applies by token text at load (llama-vocab.cpp)."""
        n = len(self.tokens)
        if self.eot_id is None:
            for text in sorted(_EOT_TEXTS):
                tid = self.token_to_id.get(text)
                if tid is not None:
                    self.eot_id = tid
                    break
        eog: set[int] = set()
        for text in _EOG_TEXTS:
            tid = self.token_to_id.get(text)
            if tid is not None:
                eog.add(tid)
                self.attrs[tid] |= ATTR_CONTROL
        for tid in (self.eot_id, self.eom_id):
            if tid is not None:
                self.attrs[tid] |= ATTR_CONTROL
        for text in _ALWAYS_RENDERED_TEXTS:
            tid = self.token_to_id.get(text)
            if tid is not None:
                self.attrs[tid] = ATTR_USER_DEFINED
        for tid in (self.eos_id, self.eot_id, self.eom_id):
            if tid is not None:
                eog.add(tid)
        texts = {self.tokens[t] for t in eog if 0 <= t < n}
        if "<|end|>" in texts and (("<|return|>" in texts and "<|call|>" in texts)
                                   or ("<|calls|>" in texts and "<|flush|>" in texts)):
            end_id = self.token_to_id["<|end|>"]
            eog.discard(end_id)
            self.attrs[end_id] = ATTR_USER_DEFINED
        self.eog_ids: frozenset[int] = frozenset(eog)

    def _build_hf_bpe(self, metadata: Mapping[str, Any]) -> Any:
        from tokenizers import Regex, pre_tokenizers
        from tokenizers import Tokenizer as HFTokenizer
        from tokenizers.models import BPE

        merges_raw = _meta(metadata, "tokenizer.ggml.merges")
        if merges_raw is None:
            raise ModelFileError(f"{self.source}: tokenizer.ggml.merges is missing (needed by the gpt2 BPE).")
        merges: list[tuple[str, str]] = []
        skipped = 0
        for m in merges_raw:
            m = str(m)
            pos = m.find(" ", 1)
            if pos < 0:
                skipped += 1
                continue
            a, b = m[:pos], m[pos + 1:]
            if a not in self.token_to_id or b not in self.token_to_id or (a + b) not in self.token_to_id:
                skipped += 1
                continue
            merges.append((a, b))
        if skipped:
            log.warning("tokenizer_merges_skipped", source=self.source, skipped=skipped, kept=len(merges))
        self._bpe_ranks = {pair: rank for rank, pair in enumerate(merges)}
        self._missing_bytes = frozenset(b for b, ch in _BYTE_TO_CHAR.items() if ch not in self.token_to_id)
        model = BPE(vocab=dict(self.token_to_id), merges=merges, ignore_merges=self.pre_rule.ignore_merges,
                    unk_token=None, fuse_unk=False, byte_fallback=False)
        hf = HFTokenizer(model)
        hf.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in self.regexes]
            + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False, trim_offsets=False)]
        )
        return hf

    # ------------------------------------------------------------------------------ encode
    @property
    def n_vocab(self) -> int:
        """Number of tokens (rows of token_embd)."""
        return len(self.tokens)

    def encode(self, text: str, *, add_special: bool = True, parse_special: bool = False) -> list[int]:
        """Token ids of ``text``, as llama.cpp's ``llama_tokenize``.

        Args:
            text: any Unicode text (may be empty).
            add_special: add BOS/EOS where the model asks for them (``add_bos``/``add_eos``);
                no second BOS when the text itself starts with the BOS token.
            parse_special: match control tokens written in the text (``<|im_start|>``) as
                single tokens; user-defined tokens are always matched.

        Returns:
            ``list[int]`` of token ids in ``[0, n_vocab)``.
        """
        fragments = self._partition_special(text, parse_special)
        out: list[int] = []
        if self.model == "gpt2":
            for frag in fragments:
                if isinstance(frag, int):
                    out.append(frag)
                elif self._missing_bytes and self._missing_bytes.intersection(frag.encode("utf-8")):
                    self._bpe_slow(frag, out)
                else:
                    assert self._hf is not None  # built for every gpt2 vocabulary (__init__)
                    out.extend(self._hf.encode(frag, add_special_tokens=False).ids)
        else:
            is_prev_special = True
            for frag in fragments:
                if isinstance(frag, int):
                    out.append(frag)
                    is_prev_special = True
                    continue
                piece = (" " if self.add_space_prefix and is_prev_special else "") + frag
                self._spm_tokenize(piece.replace(" ", SPM_SPACE), out)
                is_prev_special = False
        if add_special:
            if self.add_bos and self.bos_id is not None and not (out and out[0] == self.bos_id):
                out.insert(0, self.bos_id)
            if self.add_eos and self.eos_id is not None:
                out.append(self.eos_id)
        return out

    def _bpe_slow(self, text: str, out: list[int]) -> None:
        """Byte-level BPE of text holding bytes the vocabulary lacks, as llama.cpp does it.

        HF's BPE drops an unknown character before merging, so its neighbours can merge;
        llama.cpp keeps it as a symbol that merges with nothing and then emits nothing for it
        (llm_tokenizer_bpe_session: no token and no byte token). Words come from the same
        pre-tokenizer; merges run here, best rank first, leftmost first on ties.
        """
        assert self._hf is not None  # gpt2 vocabularies only (encode)
        for word, _ in self._hf.pre_tokenizer.pre_tokenize_str(text):
            if self.pre_rule.ignore_merges and word in self.token_to_id:
                out.append(self.token_to_id[word])
                continue
            syms = list(word)
            while len(syms) > 1:
                best, best_i = None, -1
                for i in range(len(syms) - 1):
                    rank = self._bpe_ranks.get((syms[i], syms[i + 1]))
                    if rank is not None and (best is None or rank < best):
                        best, best_i = rank, i
                if best is None:
                    break
                syms[best_i:best_i + 2] = [syms[best_i] + syms[best_i + 1]]
            for sym in syms:
                tid = self.token_to_id.get(sym)
                if tid is not None:
                    out.append(tid)
                else:  # llama.cpp looks each UTF-8 byte of the symbol up as a one-byte token
                    for byte in sym.encode("utf-8"):
                        bt = self.token_to_id.get(chr(byte)) if byte < 0x80 else None
                        if bt is not None:
                            out.append(bt)

    def _partition_special(self, text: str, parse_special: bool) -> list[str | int]:
        """llama.cpp's tokenizer_st_partition: split out special tokens, longest text first."""
        if not text:
            return []
        fragments: list[str | int] = [text]
        for tid in self._special_ids:
            attr = self.attrs[tid]
            if not parse_special and attr & (ATTR_CONTROL | ATTR_UNKNOWN):
                continue
            needle = self.tokens[tid]
            if not any(isinstance(f, str) and needle in f for f in fragments):
                continue
            new: list[str | int] = []
            for frag in fragments:
                if isinstance(frag, int) or needle not in frag:
                    new.append(frag)
                    continue
                parts = frag.split(needle)
                for k, part in enumerate(parts):
                    if part:
                        new.append(part)
                    if k < len(parts) - 1:
                        new.append(tid)
            fragments = new
        return fragments

    def _spm_tokenize(self, text: str, out: list[int]) -> None:
        """llama.cpp's llm_tokenizer_spm_session: merge the best-scoring adjacent pair first."""
        if not text:
            return
        chars = list(text)  # one symbol per code point
        n = len(chars)
        sym_text = chars[:]
        prev = list(range(-1, n - 1))
        nxt = list(range(1, n + 1))
        nxt[-1] = -1
        alive = [True] * n
        heap: list[tuple[float, int, int, str]] = []

        def try_add(left: int, right: int) -> None:
            if left == -1 or right == -1:
                return
            merged = sym_text[left] + sym_text[right]
            tid = self.token_to_id.get(merged)
            if tid is None:
                return
            heapq.heappush(heap, (-self.scores[tid], left, right, merged))

        for i in range(1, n):
            try_add(i - 1, i)
        while heap:
            _, left, right, merged = heapq.heappop(heap)
            if not alive[left] or not alive[right] or sym_text[left] + sym_text[right] != merged:
                continue
            sym_text[left] = merged
            alive[right] = False
            nxt[left] = nxt[right]
            if nxt[right] >= 0:
                prev[nxt[right]] = left
            try_add(prev[left], left)
            try_add(left, nxt[left])
        i = 0
        while i != -1:
            piece = sym_text[i]
            tid = self.token_to_id.get(piece)
            if tid is not None:
                out.append(tid)
            else:
                for byte in piece.encode("utf-8"):
                    out.append(self._spm_byte_token(byte))
            i = nxt[i]

    def _spm_byte_token(self, byte: int) -> int:
        tid = self.token_to_id.get(f"<0x{byte:02X}>")
        if tid is None:
            tid = self.token_to_id.get(chr(byte)) if byte < 0x80 else None
        if tid is None:
            raise ModelFileError(f"{self.source}: the vocabulary has no byte token <0x{byte:02X}> for byte fallback.")
        return tid

    # ------------------------------------------------------------------------------ decode
    def _piece(self, tid: int, *, special: bool) -> bytes:
        """llama.cpp's token_to_piece (no lstrip): the bytes token ``tid`` stands for."""
        attr = self.attrs[tid]
        text = self.tokens[tid]
        if attr & (ATTR_UNKNOWN | ATTR_CONTROL):
            return text.encode("utf-8") if special else b""
        if attr & ATTR_USER_DEFINED:
            return text.encode("utf-8")
        if attr & ATTR_NORMAL:
            if self.model == "gpt2":
                return _decode_byte_level(text)
            return text.replace(SPM_SPACE, " ").encode("utf-8")
        if attr & ATTR_BYTE:
            if self.model == "llama" or text.startswith("<0x"):
                return bytes([int(text[3:5], 16)])
            return _decode_byte_level(text)
        return b""  # unused / undefined tokens render as nothing

    def token_to_piece(self, token_id: int, *, special: bool = False) -> bytes:
        """Bytes of one token (possibly a partial UTF-8 sequence); control tokens are ``b""``
        unless ``special``."""
        return (self._pieces_special if special else self._pieces)[token_id]

    def decode_bytes(self, ids: Iterable[int], *, special: bool = False) -> bytes:
        """Concatenated pieces of ``ids`` (llama.cpp's token_to_piece per token)."""
        table = self._pieces_special if special else self._pieces
        return b"".join(table[i] for i in ids)

    def decode(self, ids: Iterable[int], *, special: bool = False) -> str:
        """Text of ``ids``; invalid UTF-8 (a cut multi-byte character) becomes U+FFFD."""
        return self.decode_bytes(ids, special=special).decode("utf-8", errors="replace")

    def is_eog(self, token_id: int) -> bool:
        """True when ``token_id`` ends generation (EOS, EOT, ``<|im_end|>``, ...)."""
        return token_id in self.eog_ids

    # -------------------------------------------------------------------------------- chat
    @property
    def chat(self) -> ChatTemplate:
        """The compiled ``tokenizer.chat_template``.

        Raises:
            ModelFileError: the model has no chat template, or it does not compile.
        """
        if self._chat is None:
            error = getattr(self, "_chat_error", None)
            if error is not None:  # compiled once: a broken template is not recompiled per request
                raise error
            try:
                if not self.chat_template:
                    raise ModelFileError(f"{self.source}: the model has no tokenizer.chat_template.")
                self._chat = ChatTemplate(
                    self.chat_template,
                    bos_token=self.tokens[self.bos_id] if self.bos_id is not None else "",
                    eos_token=self.tokens[self.eos_id] if self.eos_id is not None else "",
                    source=f"{self.source}: tokenizer.chat_template",
                )
            except (ModelFileError, ChatTemplateError) as exc:
                self._chat_error = exc
                raise
        return self._chat

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = True,
                            **extra: Any) -> str:
        """Render ``messages`` (``[{"role": ..., "content": ...}, ...]``) with the model's template."""
        return self.chat.render(messages, add_generation_prompt=add_generation_prompt, **extra)

    def encode_chat(self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = True,
                    **extra: Any) -> list[int]:
        """Render then tokenize with special tokens parsed and exactly one BOS where the model wants one."""
        text = self.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, **extra)
        return self.encode(text, add_special=True, parse_special=True)


class IncrementalDetokenizer:
    """Streaming decode: feed token ids one by one, get back only complete UTF-8 text.

    A token may end inside a multi-byte character (byte-level BPE splits emoji and CJK across
    tokens); those bytes are held until the character completes. Invalid sequences become
    U+FFFD, as :meth:`Tokenizer.decode` does.
    """

    def __init__(self, tokenizer: Tokenizer, *, special: bool = False):
        self.tokenizer = tokenizer
        self.special = special
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_id: int) -> str:
        """Add one token; return the newly completed text (may be ``""``)."""
        return self._decoder.decode(self.tokenizer.token_to_piece(token_id, special=self.special))

    def flush(self) -> str:
        """End of stream: return what is still held (an incomplete character becomes U+FFFD)."""
        return self._decoder.decode(b"", final=True)


# ------------------------------------------------------------------------------ chat template
class ChatTemplateError(ValueError):
    """A chat template failed to compile or to render a conversation.

    ``kind`` is ``"syntax"`` (the template itself is broken), ``"raised"`` (the template
    called ``raise_exception``, e.g. roles that do not alternate: a bad request),
    ``"timeout"`` (the render ran past its time or size budget: a runaway loop) or
    ``"render"`` (any other error while rendering). Only ``"raised"`` is the client's doing.
    """

    def __init__(self, message: str, kind: str):
        super().__init__(message)
        self.kind = kind


class _TemplateRaised(Exception):
    pass


class _RenderOverBudget(Exception):
    pass


class _RenderBudget:
    """One render's deadline and output/operand size limit, checked at every call, attribute
    and item access, loop step over context lists, string or list multiplication and output
    chunk of a template (jinja2 has no time limit of its own: nested loops over a few hundred
    messages, or ranges inside ranges, run for hours)."""

    def __init__(self, timeout_s: float, max_chars: int):
        import time

        self._clock = time.monotonic
        self.deadline = self._clock() + timeout_s
        self.timeout_s = timeout_s
        self.max_chars = max_chars
        self.output = 0
        self._n = 0

    def tick(self) -> None:
        self._n += 1
        if not self._n & 63 and self._clock() > self.deadline:
            raise _RenderOverBudget(f"the render ran longer than {self.timeout_s:g} s (a runaway loop?)")

    def size(self, n: int) -> None:
        if n > self.max_chars:
            raise _RenderOverBudget(f"the render built a value of {n} items, more than {self.max_chars}")

    def add_output(self, n: int) -> None:
        self.output += n
        self.size(self.output)
        if self._clock() > self.deadline:
            raise _RenderOverBudget(f"the render ran longer than {self.timeout_s:g} s (a runaway loop?)")


def _bounded_sandbox(base):
    """``base`` (a jinja2 sandbox class) that charges every call, attribute and item access to
    the current thread's :class:`_RenderBudget` and refuses ``*``/``**`` results past its size
    limit (the sandbox's own limits stop at range(): 'a' * 10**9 is allowed)."""

    class BoundedSandbox(base):  # type: ignore[valid-type,misc]  # a base chosen at run time
        intercepted_binops = frozenset(["*", "**"])

        def _tick(self) -> None:
            _tick()

        def call(self, __context, __obj, *args, **kwargs):
            self._tick()
            return super().call(__context, __obj, *args, **kwargs)

        def getattr(self, obj, attribute):
            self._tick()
            return super().getattr(obj, attribute)

        def getitem(self, obj, argument):
            self._tick()
            return super().getitem(obj, argument)

        def call_binop(self, context, operator, left, right):
            b = getattr(_RENDER, "budget", None)
            if b is not None:
                b.tick()
                if operator == "*":
                    for seq, k in ((left, right), (right, left)):
                        if isinstance(seq, str | list | tuple) and isinstance(k, int):
                            b.size(len(seq) * k)
                elif operator == "**" and isinstance(left, int) and isinstance(right, int) and right > 64:
                    raise _RenderOverBudget(f"the render computed {left} ** {right}")
            return super().call_binop(context, operator, left, right)

    return BoundedSandbox


class _TickingList(list):
    """A context list whose iteration is charged to the render budget (loops over messages
    make no calls the sandbox could count)."""

    def __iter__(self):
        for item in list.__iter__(self):
            _tick()
            yield item


_RENDER = threading.local()  # .budget: the _RenderBudget of this thread's render in progress


def _tick() -> None:
    b = getattr(_RENDER, "budget", None)
    if b is not None:
        b.tick()


def _raise_exception(message: str) -> None:
    raise _TemplateRaised(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    # HF transformers' tojson: no HTML escaping, unicode kept.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


class ChatTemplate:
    """A jinja2 chat template compiled in a sandbox (HF transformers' conventions).

    Variables available to the template: ``messages``, ``add_generation_prompt``,
    ``bos_token``, ``eos_token``, plus any keyword passed to :meth:`render` (``tools``, ...);
    functions ``raise_exception(msg)`` and ``strftime_now(fmt)``; filter ``tojson``.

    Raises:
        ChatTemplateError: (kind ``"syntax"``) when the source does not compile, naming the line.
    """

    def __init__(self, template: str, *, bos_token: str = "", eos_token: str = "",
                 source: str = "chat template", timeout_s: float = 5.0, max_chars: int = 16 << 20):
        self.timeout_s = timeout_s  # a render that runs longer stops (ChatTemplateError "timeout")
        self.max_chars = max_chars  # most characters a render may produce or build
        import jinja2
        import jinja2.ext
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        self.template_source = template
        self.source = source
        self.bos_token = bos_token
        self.eos_token = eos_token
        env = _bounded_sandbox(ImmutableSandboxedEnvironment)(trim_blocks=True, lstrip_blocks=True,
                                                              extensions=[jinja2.ext.loopcontrols])
        self._env = env
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        try:
            self._template = env.from_string(template)
        except jinja2.TemplateSyntaxError as exc:
            raise ChatTemplateError(f"{source}: syntax error at line {exc.lineno}: {exc.message}",
                                    "syntax") from exc

    def render(self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = True,
               **extra: Any) -> str:
        """The prompt text for ``messages``.

        Raises:
            ChatTemplateError: ``"raised"`` when the template rejects the conversation
                (its own message is kept), ``"render"`` for any other failure.
        """
        import jinja2

        context = {"bos_token": self.bos_token, "eos_token": self.eos_token, **extra,
                   "messages": _TickingList(dict(m) for m in messages), "add_generation_prompt": add_generation_prompt}
        budget = _RenderBudget(self.timeout_s, self.max_chars)
        _RENDER.budget = budget
        try:
            parts = []
            for chunk in self._template.generate(**context):
                budget.add_output(len(chunk))
                parts.append(chunk)
            return "".join(parts)
        except _TemplateRaised as exc:
            raise ChatTemplateError(f"{self.source} rejected the conversation: {exc}", "raised") from exc
        except _RenderOverBudget as exc:
            raise ChatTemplateError(f"{self.source} stopped: {exc}", "timeout") from exc
        except (jinja2.TemplateError, TypeError, ValueError, KeyError, IndexError, AttributeError,
                RecursionError, OverflowError, ArithmeticError) as exc:
            raise ChatTemplateError(f"{self.source} failed to render: {type(exc).__name__}: {exc}",
                                    "render") from exc
        finally:
            _RENDER.budget = None


# ----------------------------------------------------------------------------- GGUF metadata
_GGUF_SCALAR_FORMATS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
                        10: "<Q", 11: "<q", 12: "<d"}
_GGUF_NUMPY_DTYPES = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "<u1",
                      10: "<u8", 11: "<i8", 12: "<f8"}
_GGUF_STRING, _GGUF_ARRAY = 8, 9


def read_gguf_metadata(path: str | Path, prefixes: tuple[str, ...] | None = None) -> dict[str, Any]:
    """KV metadata of a GGUF file as plain Python values (str, int, float, bool, lists).

    A direct parse of the header (magic, u32 version, u64 tensor count, u64 KV count, then
    ``key: string, u32 type, value`` pairs; strings are u64 length + UTF-8): gguf's GGUFReader
    builds one numpy view per array element and needs ~9 s for a 49k-token vocabulary, this
    needs well under a second. Tensor infos are not read.

    Args:
        path: a .gguf file (the first shard of a split set carries the tokenizer).
        prefixes: keep only keys starting with one of these (all keys when ``None``).

    Raises:
        ModelFileError: the file is missing, not GGUF, or its header is truncated.
    """
    import struct

    import numpy as np

    path = Path(path)
    try:
        with open(path, "rb") as f:
            head = f.read(24)
            if len(head) < 24 or head[:4] != b"GGUF":
                raise ModelFileError(f"{path}: not a GGUF file (bad magic {head[:4]!r}).")
            version, _n_tensors, n_kv = struct.unpack_from("<IQQ", head, 4)
            if version not in (2, 3):
                raise ModelFileError(f"{path}: GGUF version {version} is not supported (2 or 3).")
            # Metadata is small next to the tensors but its size is unknown: read growing chunks.
            buf = bytearray(head)
            chunk = 1 << 22

            def need(end: int) -> None:
                nonlocal chunk
                while len(buf) < end:
                    more = f.read(max(chunk, end - len(buf)))
                    if not more:
                        raise ModelFileError(f"{path}: truncated GGUF header (needed byte {end}).")
                    buf.extend(more)
                    chunk *= 2

            pos = 24

            def read_str() -> str:
                nonlocal pos
                need(pos + 8)
                (n,) = struct.unpack_from("<Q", buf, pos)
                need(pos + 8 + n)
                s = bytes(buf[pos + 8:pos + 8 + n]).decode("utf-8", errors="replace")
                pos += 8 + n
                return s

            def read_value(vtype: int) -> Any:
                nonlocal pos
                if vtype == _GGUF_STRING:
                    return read_str()
                if vtype == _GGUF_ARRAY:
                    need(pos + 12)
                    etype, count = struct.unpack_from("<IQ", buf, pos)
                    pos += 12
                    if etype == _GGUF_STRING:
                        return [read_str() for _ in range(count)]
                    if etype in _GGUF_NUMPY_DTYPES:
                        dt = np.dtype(_GGUF_NUMPY_DTYPES[etype])
                        need(pos + dt.itemsize * count)
                        arr = np.frombuffer(bytes(buf[pos:pos + dt.itemsize * count]), dtype=dt)
                        pos += dt.itemsize * count
                        return [bool(v) for v in arr] if etype == 7 else arr.tolist()
                    return [read_value(etype) for _ in range(count)]
                fmt = _GGUF_SCALAR_FORMATS.get(vtype)
                if fmt is None:
                    raise ModelFileError(f"{path}: unknown GGUF value type {vtype} at byte {pos}.")
                size = struct.calcsize(fmt)
                need(pos + size)
                (v,) = struct.unpack_from(fmt, buf, pos)
                pos += size
                return v

            out: dict[str, Any] = {}
            for _ in range(n_kv):
                key = read_str()
                need(pos + 4)
                (vtype,) = struct.unpack_from("<I", buf, pos)
                pos += 4
                value = read_value(vtype)
                if prefixes is None or key.startswith(prefixes):
                    out[key] = value
            return out
    except OSError as exc:
        raise ModelFileError(f"{path}: cannot read GGUF metadata: {exc}") from exc
