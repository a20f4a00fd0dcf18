"""A state-space model's config names no attention heads (state-spaces/mamba-130m-hf, tiiuae/falcon-mamba-7b): it is
sized with no KV cache, where any other config without heads is still refused in one sentence."""

from __future__ import annotations

import pytest

from factory.checkpoints.inspection import check_config
from factory.engines.gguf import memory
from factory.errors import ModelRefused
from factory.vram import Shape

# state-spaces/mamba-130m-hf's config.json, its sizes
MAMBA = {
    "model_type": "mamba",
    "hidden_size": 768,
    "num_hidden_layers": 24,
    "intermediate_size": 1536,
    "vocab_size": 50280,
    "state_size": 16,
}


@pytest.mark.parametrize("model_type", ["mamba", "falcon_mamba"])
def test_a_state_space_model_is_sized_without_a_kv_cache(model_type):
    config = check_config({**MAMBA, "model_type": model_type})
    shape = Shape.of(config)
    assert (shape.heads, shape.kv_heads, shape.head_dim) == (0, 0, 0)
    assert memory.cache_bytes(shape, 32768) == 0


def test_a_gguf_without_attention_metadata_has_no_kv_cache():
    meta = {"general.architecture": "mamba", "mamba.embedding_length": 768, "mamba.block_count": 24}
    shape = memory.file_shape(meta)
    assert shape.kv_heads == 0 and memory.cache_bytes(shape, 8192) == 0


def test_any_other_config_without_heads_is_refused():
    with pytest.raises(ModelRefused, match="config.json has no num_attention_heads; the factory needs it"):
        check_config({**MAMBA, "model_type": "llama"})
