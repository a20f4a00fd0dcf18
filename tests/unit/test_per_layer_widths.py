"""A config that says its MLP's width once a layer (google/gemma-3n-E4B's text_config: intermediate_size a list of 35)
is sized by its widest layer, where a list of anything but widths is still refused in one sentence."""

from __future__ import annotations

import pytest

from factory.checkpoints.inspection import check_config, with_standard_names
from factory.errors import ModelRefused
from factory.vram import Shape

# google/gemma-3n-E4B-it's text_config, its sizes
GEMMA3N = {
    "model_type": "gemma3n_text",
    "hidden_size": 2048,
    "num_hidden_layers": 35,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 256,
    "intermediate_size": [16384] * 35,
    "vocab_size": 262400,
}


def test_a_width_per_layer_is_sized_by_the_widest():
    config = check_config(with_standard_names({**GEMMA3N, "intermediate_size": [8192] * 20 + [16384] * 15}))
    assert config["intermediate_size"] == 16384
    assert Shape.of(config).intermediate == 16384


def test_a_list_of_anything_but_widths_is_refused():
    with pytest.raises(ModelRefused, match="config.json: intermediate_size must be an integer"):
        check_config(with_standard_names({**GEMMA3N, "intermediate_size": ["16384"] * 35}))
