"""Synthetic writers: every registry format as --expert-type, per-tensor type recipes
(synth_recipe.py), --sparse headers that `moe-service check` plans with per-node bytes equal to
the sum of the tensors' sizes, and a tensor whose row is not whole blocks refused (exit 3)."""

from __future__ import annotations

import contextlib
import io
import json

import gguf
import numpy as np
import pytest

from moe_service import synth, synth_deepseek2, synth_deepseek4, synth_gpt_oss
from moe_service.cli import main as cli_main
from moe_service.errors import ConfigError
from moe_service.synth_recipe import apply_tensor_types, parse_tensor_types
from tests.support.gguf_factory import patch_tensor_info

UD_QWEN = "gate=IQ1_S,up=IQ1_S,down=IQ2_XXS,experts@0=Q4_K,down@1=IQ3_S,attn=Q8_0,attn@1=Q6_K"
UD_DEEPSEEK = "gate=IQ1_M,up=IQ2_XS,down=IQ2_S,experts@2=IQ3_XXS,attn=Q8_0,shexp=Q6_K,ffn=IQ4_XS,embd=IQ4_NL"


def _check_json(path) -> tuple[int, dict]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        code = cli_main(["check", "--model", str(path), "--json"])
    return code, json.loads(out.getvalue())


def _check_text(path) -> tuple[int, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli_main(["check", "--model", str(path)])
    return code, out.getvalue() + err.getvalue()


def test_parse_rules_and_errors():
    r = parse_tensor_types("gate=IQ1_S, down@2-3=q4_k,experts@5=IQ2_XXS")
    assert [(x.role, x.qtype, x.layers) for x in r] == [("gate", "IQ1_S", None), ("down", "Q4_K", (2, 3)),
                                                       ("experts", "IQ2_XXS", (5, 5))]
    assert parse_tensor_types("") == ()
    for bad, words in (("gate", "is not ROLE"), ("mlp=Q4_K", "unknown role 'mlp'"), ("gate=TQ1_0", "TQ1_0 is not"),
                       ("gate=F16", "F16 is not"), ("down@3-1=Q4_K", "is empty")):
        with pytest.raises(ConfigError, match=words):
            parse_tensor_types(bad)


def test_recipe_types_per_role_and_layer():
    p = synth.resolve_preset("tiny-qwen3moe", n_layer=3)
    plans = {t.name: t for t in apply_tensor_types(synth.tensor_plan(p), UD_QWEN, "x")}
    assert plans["blk.0.ffn_gate_exps.weight"].qtype == "Q4_K" and plans["blk.0.ffn_down_exps.weight"].qtype == "Q4_K"
    assert plans["blk.1.ffn_gate_exps.weight"].qtype == "IQ1_S" and plans["blk.1.ffn_down_exps.weight"].qtype == "IQ3_S"
    assert plans["blk.2.ffn_up_exps.weight"].qtype == "IQ1_S" and plans["blk.2.ffn_down_exps.weight"].qtype == "IQ2_XXS"
    assert plans["blk.1.attn_q.weight"].qtype == "Q6_K" and plans["blk.2.attn_output.weight"].qtype == "Q8_0"
    assert plans["blk.0.ffn_gate_inp.weight"].qtype == "F32" and plans["blk.0.attn_norm.weight"].qtype == "F32"
    t = plans["blk.2.ffn_down_exps.weight"]
    assert t.nbytes == int(np.prod(t.ne)) // 256 * 66


def test_recipe_errors_name_the_tensor_or_rule():
    p = synth.resolve_preset("tiny-qwen3moe", n_ff_exp=288)
    with pytest.raises(ConfigError, match=r"blk\.0\.ffn_down_exps\.weight has rows of 288 elements.*IQ2_XXS block 256"):
        apply_tensor_types(synth.tensor_plan(p), "down=IQ2_XXS", "x")
    with pytest.raises(ConfigError, match="'shexp=Q4_K' matches no tensor"):
        apply_tensor_types(synth.tensor_plan(p), "shexp=Q4_K", "x")
    with pytest.raises(ConfigError, match="'experts@9=Q4_K' matches no tensor"):
        apply_tensor_types(synth.tensor_plan(p), "experts@9=Q4_K", "x")


def _plan_bytes_match(path) -> None:
    code, rep = _check_json(path)
    assert code == 0 and rep["ready"], rep["problems"]
    total = sum(int(t.n_bytes) for t in gguf.GGUFReader(path).tensors)
    assert sum(rep["plan"]["bytes_per_node"].values()) == total


def test_sparse_qwen3moe_recipe_is_ready_with_exact_bytes(tmp_path):
    path = synth.write_synthetic(tmp_path / "q.gguf", "tiny-qwen3moe", n_layer=3, sparse=True, tensor_types=UD_QWEN)
    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(path).tensors}
    assert types["blk.2.ffn_gate_exps.weight"] == "IQ1_S" and types["blk.1.ffn_down_exps.weight"] == "IQ3_S"
    _plan_bytes_match(path)


def test_sparse_deepseek2_recipe_is_ready_with_exact_bytes(tmp_path):
    path = synth_deepseek2.write_deepseek2(tmp_path / "d.gguf", "tiny-deepseek2", n_layer=3, sparse=True,
                                           tensor_types=UD_DEEPSEEK)
    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(path).tensors}
    assert types["blk.1.ffn_gate_exps.weight"] == "IQ1_M" and types["blk.2.ffn_down_exps.weight"] == "IQ3_XXS"
    assert types["blk.0.ffn_down.weight"] == "IQ4_XS" and types["token_embd.weight"] == "IQ4_NL"
    _plan_bytes_match(path)


def test_every_writer_writes_sparse_headers_with_a_recipe(tmp_path):
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert synth.main(["--preset", "tiny-llama", "--out", str(tmp_path / "l.gguf"), "--sparse",
                           "--expert-type", "IQ2_XS", "--tensor-types", "down=IQ3_S"]) == 0
        assert synth_gpt_oss.main(["--preset", "tiny-gpt-oss", "--out", str(tmp_path / "g.gguf"), "--sparse",
                                   "--tensor-types", "gate=IQ4_NL,up=IQ4_NL,attn=Q6_K"]) == 0
        assert synth_deepseek4.main(["--preset", "tiny-deepseek4", "--out", str(tmp_path / "v4.gguf"), "--sparse",
                                     "--tensor-types", "gate=IQ2_XXS,up=IQ2_XXS,down=Q2_K"]) == 0
    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(tmp_path / "l.gguf").tensors}
    assert types["blk.0.ffn_gate_exps.weight"] == "IQ2_XS" and types["blk.1.ffn_down_exps.weight"] == "IQ3_S"
    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(tmp_path / "g.gguf").tensors}
    assert types["blk.0.ffn_gate_exps.weight"] == "IQ4_NL" and types["blk.0.attn_q.weight"] == "Q6_K"
    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(tmp_path / "v4.gguf").tensors}
    assert "IQ2_XXS" in types.values() and "Q2_K" in types.values()
    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        assert synth.main(["--preset", "tiny-llama", "--out", str(tmp_path / "x.gguf"), "--sparse",
                           "--tensor-types", "mlp=Q4_K"]) == 2
    assert "unknown role 'mlp'" in err.getvalue()


def test_row_not_whole_blocks_is_refused_naming_the_tensor(tmp_path):
    path = synth.write_synthetic(tmp_path / "q.gguf", "tiny-qwen3moe", sparse=True, tensor_types="down=IQ2_XXS")
    patch_tensor_info(path, "blk.1.ffn_down_exps.weight", ne0=128)
    code, text = _check_text(path)
    assert code == 3 and "blk.1.ffn_down_exps.weight" in text and "IQ2_XXS" in text and "256" in text
    path = synth.write_synthetic(tmp_path / "n.gguf", "tiny-qwen3moe", sparse=True, tensor_types="up=IQ4_NL")
    patch_tensor_info(path, "blk.0.ffn_up_exps.weight", ne0=48)
    code, text = _check_text(path)
    assert code == 3 and "blk.0.ffn_up_exps.weight" in text and "IQ4_NL" in text and "32" in text


def test_named_recipes_expand_and_apply_where_they_fit(tmp_path):
    from moe_service.synth.recipe import NAMED_RECIPES, expand_tensor_types

    rules = parse_tensor_types("ud-iq1_s,experts@1=Q4_K")
    assert [r.text for r in rules[:3]] == ["gate=IQ1_S", "up=IQ1_S", "down=IQ2_XXS"]
    assert {r.named for r in rules[:-1]} == {"ud-iq1_s"} and rules[-1].named is None
    assert expand_tensor_types("ud-iq2_xxs").startswith("ud-iq2_xxs:gate=IQ2_XXS,")
    assert set(NAMED_RECIPES) >= {"ud-iq1_s", "ud-iq2_xxs"}
    with pytest.raises(ConfigError, match="nor a named recipe"):
        parse_tensor_types("ud-iq9")
    # qwen3moe has no shared experts nor dense FFN layers: a named recipe's rules for them are
    # no error; a rule the user typed is
    path = synth.write_synthetic(tmp_path / "q.gguf", "tiny-qwen3moe", n_layer=2, sparse=True,
                                 tensor_types="ud-iq2_xxs,experts@1=Q4_K")
    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(path).tensors}
    assert types["blk.0.ffn_up_exps.weight"] == "IQ2_XXS" and types["blk.0.ffn_down_exps.weight"] == "Q2_K"
    assert types["blk.1.ffn_down_exps.weight"] == "Q4_K" and types["blk.0.attn_k.weight"] == "Q6_K"
    _plan_bytes_match(path)
    with pytest.raises(ConfigError, match="matches no tensor"):
        synth.write_synthetic(tmp_path / "x.gguf", "tiny-qwen3moe", sparse=True, tensor_types="ud-iq1_s,shexp=Q6_K")
