"""deepseek2 header checks beyond shapes (the x0/x2/x64/+1/-1 mutation of every numeric key
runs in tests/moe_service/engine/arch/test_arch_mutations.py with the other architectures): multi-token
prediction blocks, unsupported query temperature, KV head count of each MLA form."""

from __future__ import annotations

import pytest

from moe_service.engine import arch as archs
from moe_service.gguf_model import GGUFModel
from moe_service.synth_deepseek2 import resolve_preset, write_deepseek2
from tests.support.smollm2 import needs_smollm2

pytestmark = needs_smollm2

PRESET = resolve_preset("tiny-deepseek2", n_layer=2, expert_type="Q8_0")


def test_nextn_blocks_are_not_part_of_the_trunk(tmp_path):
    """deepseek2.nextn_predict_layers: the last blocks are multi-token-prediction heads
    (llama.cpp's n_layer() excludes them); the decode trunk is block_count minus them."""
    path = write_deepseek2(tmp_path / "mtp.gguf", PRESET, metadata_overrides={"deepseek2.nextn_predict_layers": 1})
    cat = GGUFModel.open(path)
    assert archs.check_model(cat) == []
    assert archs.for_model(cat).hp.n_layer == PRESET.n_layer - 1


def test_query_temperature_scaling_is_refused_naming_the_key(tmp_path):
    path = write_deepseek2(tmp_path / "t.gguf", PRESET, metadata_overrides={"deepseek2.attention.temperature_scale": 0.1})
    (p,) = archs.check_model(GGUFModel.open(path))
    assert str(path) in p.message and "deepseek2.attention.temperature_scale" in p.message


def test_kv_head_count_must_match_the_mla_form(tmp_path):
    path = write_deepseek2(tmp_path / "kv.gguf", PRESET, metadata_overrides={"deepseek2.attention.head_count_kv": 4})
    (p,) = archs.check_model(GGUFModel.open(path))
    assert "deepseek2.attention.head_count_kv = 4, expected 1" in p.message


def test_experts_per_token_beyond_the_kept_groups_is_a_config_error(tmp_path):
    from moe_service.errors import ConfigError

    cat = GGUFModel.open(write_deepseek2(tmp_path / "g.gguf", PRESET))  # 4 groups of 4, 2 kept: 8 selectable
    arch = archs.for_model(cat)
    assert arch.routing(8).k == 8 and arch.routing(0).k == PRESET.n_expert_used
    with pytest.raises(ConfigError, match="experts_per_token = 9"):
        arch.routing(9)
