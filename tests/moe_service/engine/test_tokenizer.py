"""Tokenizer: unit behaviour, plus llama.cpp's tokenization of the corpus (golden fixtures)."""

from __future__ import annotations

import pytest

from moe_service.engine.tokenizer import (
    ChatTemplate,
    ChatTemplateError,
    IncrementalDetokenizer,
    Tokenizer,
    read_gguf_metadata,
)
from moe_service.errors import ModelFileError
from tests.fixtures.golden import (
    chat_fixture,
    load_corpus,
    tokenize_fixture,
    tokenize_fixture_names,
    vocab_metadata_for,
)
from tests.support.smollm2 import needs_smollm2

_TOKENIZERS: dict[str, Tokenizer] = {}


def tokenizer_for(name: str) -> Tokenizer:
    if name not in _TOKENIZERS:
        fx = tokenize_fixture(name)
        _TOKENIZERS[name] = Tokenizer.from_gguf(vocab_metadata_for(fx["source"]), source=name)
    return _TOKENIZERS[name]


def _expected(tok: Tokenizer, ref: list[int], text: str, parse_special: bool) -> list[int]:
    # Documented difference: llama.cpp adds BOS even when the text already starts with it.
    if (parse_special and tok.add_bos and tok.bos_id is not None and ref[:2] == [tok.bos_id, tok.bos_id]
            and text.startswith(tok.tokens[tok.bos_id])):
        return ref[1:]
    return ref


@needs_smollm2
@pytest.mark.parametrize("vocab", tokenize_fixture_names())
def test_corpus_tokenization_matches_llama_cpp(vocab):
    fx = tokenize_fixture(vocab)
    tok = tokenizer_for(vocab)
    assert tok.n_vocab == fx["n_vocab"]
    corpus = load_corpus()
    mismatches = []
    for key, parse_special in (("false", False), ("true", True)):
        for text, ref in zip(corpus, fx["ids"][key], strict=True):
            got = tok.encode(text, add_special=True, parse_special=parse_special)
            if got != _expected(tok, ref, text, parse_special):
                mismatches.append((parse_special, text, ref, got))
    assert not mismatches, f"{len(mismatches)} mismatches, first: {mismatches[0]}"


@needs_smollm2
@pytest.mark.parametrize("vocab", ["smollm2", "qwen2-151936", "spm-32000", "smollm2-pre-gpt-4o"])
def test_decode_matches_llama_cpp_token_to_piece(vocab):
    import hashlib

    fx = tokenize_fixture(vocab)
    tok = tokenizer_for(vocab)
    for key, special in (("false", False), ("true", True)):
        h = hashlib.sha256()
        for t in range(tok.n_vocab):
            piece = tok.token_to_piece(t, special=special)
            h.update(len(piece).to_bytes(4, "little"))
            h.update(piece)
        assert h.hexdigest() == fx["pieces_sha256"][key], f"piece table differs (special={special})"
        for ids, ref in zip(fx["ids"][key], fx["decoded"][key], strict=True):
            assert tok.decode(ids, special=special) == ref


@needs_smollm2
@pytest.mark.parametrize("vocab", ["smollm2", "qwen2-151936"])
def test_chat_template_matches_llama_cpp(vocab):
    fx = chat_fixture(vocab)
    tok = Tokenizer.from_gguf(vocab_metadata_for(fx["source"]), source=vocab)
    assert tok.chat_template == fx["template"]
    for case in fx["cases"]:
        text = tok.apply_chat_template(case["messages"], add_generation_prompt=case["add_generation_prompt"])
        assert text == case["rendered"]
        assert tok.encode_chat(case["messages"], add_generation_prompt=case["add_generation_prompt"]) == case["ids"]
        # llama.cpp's built-in (non-jinja) chatml agrees whenever the template adds no default system turn
        if case["llama_cpp_builtin"] is not None and case["messages"][0]["role"] == "system":
            assert text == case["llama_cpp_builtin"]


@needs_smollm2
def test_special_tokens_and_eog_smollm2():
    tok = tokenizer_for("smollm2")
    assert (tok.bos_id, tok.eos_id, tok.add_bos, tok.add_eos) == (1, 2, False, False)
    assert tok.is_eog(2) and tok.is_eog(0)  # <|im_end|>, <|endoftext|>
    plain = tok.encode("<|im_start|>", parse_special=False)
    assert plain != [1] and len(plain) > 1
    assert tok.encode("<|im_start|>", parse_special=True) == [1]
    assert tok.decode([1, 9690], special=False) == "system"
    assert tok.decode([1, 9690], special=True) == "<|im_start|>system"


@needs_smollm2
def test_user_defined_tokens_always_split_control_only_when_asked():
    tok = tokenizer_for("qwen2-151936")
    think = tok.token_to_id["<think>"]
    im_end = tok.token_to_id["<|im_end|>"]
    assert (think, im_end) == (151646, 151645)  # Qwen's layout: specials from 151643
    assert think in tok.encode("a<think>b", parse_special=False)
    assert im_end not in tok.encode("a<|im_end|>b", parse_special=False)
    assert im_end in tok.encode("a<|im_end|>b", parse_special=True)
    assert tok.decode([think]) == "<think>"  # user-defined tokens render as text
    assert tok.decode([im_end]) == ""


@needs_smollm2
def test_exactly_one_bos_when_text_starts_with_it():
    tok = tokenizer_for("spm-32000")
    assert tok.add_bos and tok.bos_id == 1
    assert tok.encode("hello")[0] == 1
    ids = tok.encode("<s>hello", parse_special=True)
    assert ids[:2] != [1, 1] and ids[0] == 1
    assert tok.encode("hello", add_special=False)[0] != 1


@needs_smollm2
def test_incremental_detokenizer_holds_partial_utf8():
    tok = tokenizer_for("smollm2")
    text = "emoji 👋🏽 and 日本語 then é."
    ids = tok.encode(text)
    det = IncrementalDetokenizer(tok)
    chunks = [det.push(i) for i in ids]
    chunks.append(det.flush())
    assert "".join(chunks) == text
    assert all("\ufffd" not in c for c in chunks)
    # a multi-byte character spread over several byte-level tokens yields nothing until complete
    pieces = [tok.token_to_piece(i) for i in ids]
    assert any(p and p.decode("utf-8", errors="replace").count("\ufffd") for p in pieces)


@needs_smollm2
def test_incremental_detokenizer_flush_reports_cut_character():
    tok = tokenizer_for("smollm2")
    ids = tok.encode("👋")
    det = IncrementalDetokenizer(tok)
    assert det.push(ids[0]) == ""
    assert det.flush() == "\ufffd"


def test_chat_template_syntax_error_names_the_line():
    with pytest.raises(ChatTemplateError, match="line 2") as exc:
        ChatTemplate("hello\n{% for m in messages %}{{ m.content }", source="x.gguf: tokenizer.chat_template")
    assert exc.value.kind == "syntax"
    assert "x.gguf: tokenizer.chat_template" in str(exc.value)


def test_chat_template_raise_exception_and_render_errors():
    t = ChatTemplate("{% if messages[0].role != 'user' %}{{ raise_exception('first turn must be user') }}"
                     "{% endif %}{{ bos_token }}{{ messages[0].content }}{{ eos_token }}",
                     bos_token="<s>", eos_token="</s>")
    assert t.render([{"role": "user", "content": "hi"}]) == "<s>hi</s>"
    with pytest.raises(ChatTemplateError, match="first turn must be user") as exc:
        t.render([{"role": "assistant", "content": "hi"}])
    assert exc.value.kind == "raised"
    with pytest.raises(ChatTemplateError) as exc:
        ChatTemplate("{{ messages[5].content.upper() }}").render([])
    assert exc.value.kind == "render"


def test_chat_template_is_sandboxed_and_has_hf_helpers():
    t = ChatTemplate("{{ messages | tojson }}|{{ strftime_now('%Y') | length }}")
    assert t.render([{"role": "user", "content": "é"}]) == '[{"role": "user", "content": "é"}]|4'
    with pytest.raises(ChatTemplateError):
        ChatTemplate("{{ ''.__class__.__mro__[1].__subclasses__() }}").render([])


def test_missing_or_unknown_tokenizer_keys_are_model_file_errors():
    with pytest.raises(ModelFileError, match="tokenizer.ggml.tokens"):
        Tokenizer.from_gguf({"tokenizer.ggml.model": "gpt2"}, source="m.gguf")
    base = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": ["a", "b", "ab"],
            "tokenizer.ggml.token_type": [1, 1, 1], "tokenizer.ggml.merges": ["a b"]}
    with pytest.raises(ModelFileError, match="pre = 'nonsense'"):
        Tokenizer.from_gguf({**base, "tokenizer.ggml.pre": "nonsense"}, source="m.gguf")
    with pytest.raises(ModelFileError, match="'bert'"):
        Tokenizer.from_gguf({**base, "tokenizer.ggml.model": "bert"}, source="m.gguf")
    with pytest.raises(ModelFileError, match="merges"):
        Tokenizer.from_gguf({k: v for k, v in base.items() if k != "tokenizer.ggml.merges"}, source="m.gguf")


def test_tiny_bpe_merges_by_rank():
    meta = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "gpt-2",
            "tokenizer.ggml.tokens": ["a", "b", "c", "ab", "bc", "abc"], "tokenizer.ggml.token_type": [1] * 6,
            "tokenizer.ggml.merges": ["b c", "a b", "a bc"]}
    tok = Tokenizer.from_gguf(meta)
    # "b c" has the best rank, then "a bc"
    assert tok.encode("abc", add_special=False) == [5]
    assert tok.encode("ab", add_special=False) == [3]
    assert tok.decode([5, 0]) == "abca"


def test_tiny_spm_merges_by_score_with_byte_fallback():
    toks = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + ["\u2581", "a", "b", "ab", "\u2581ab"]
    types = [2, 3, 3] + [6] * 256 + [1] * 5
    scores = [0.0] * 259 + [-1.0, -2.0, -3.0, -4.0, -0.5]
    tok = Tokenizer.from_gguf({"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": toks,
                               "tokenizer.ggml.token_type": types, "tokenizer.ggml.scores": scores})
    ids = tok.encode("ab é")
    assert ids[0] == 1  # BOS by default for SentencePiece models
    assert ids[1] == toks.index("\u2581ab")
    assert ids[2] == toks.index("\u2581")
    assert ids[3:] == [3 + 0xC3, 3 + 0xA9]  # é has no piece: UTF-8 bytes
    assert tok.decode(ids[1:]) == " ab é"


def test_read_gguf_metadata_matches_gguf_reader(tmp_path):
    import gguf

    path = tmp_path / "m.gguf"
    w = gguf.GGUFWriter(str(path), arch="llama")
    w.add_uint32("llama.block_count", 3)
    w.add_float32("llama.rope.freq_base", 10000.5)
    w.add_bool("tokenizer.ggml.add_bos_token", True)
    w.add_array("tokenizer.ggml.tokens", ["a", "é", "日本"])
    w.add_key_value("tokenizer.ggml.token_type", [1, 3, 4], gguf.GGUFValueType.ARRAY, sub_type=gguf.GGUFValueType.INT32)
    w.add_key_value("tokenizer.ggml.scores", [0.5, -1.0, 2.0], gguf.GGUFValueType.ARRAY,
                    sub_type=gguf.GGUFValueType.FLOAT32)
    w.add_string("tokenizer.chat_template", "{{ x }}")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    w.close()
    ours = read_gguf_metadata(path)
    ref = {k: f.contents() for k, f in gguf.GGUFReader(str(path)).fields.items() if not k.startswith("GGUF.")}
    assert ours == ref
    assert read_gguf_metadata(path, prefixes=("tokenizer.",)).keys() == {k for k in ref if k.startswith("tokenizer.")}
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"NOPE" + bytes(40))
    with pytest.raises(ModelFileError, match="not a GGUF"):
        read_gguf_metadata(bad)
    trunc = tmp_path / "trunc.gguf"
    trunc.write_bytes(path.read_bytes()[:60])
    with pytest.raises(ModelFileError, match="truncated"):
        read_gguf_metadata(trunc)
