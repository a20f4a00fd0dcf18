"""Tiny seeded checkpoints of many architectures, made with transformers' own classes (`AutoConfig.for_model`,
the sizes shrunk, `from_config`), each with the tests' tiny BPE tokenizer (tests/support/tiny_model.py): what the
coverage test (tests/integration/test_coverage.py) and benchmarks/coverage.py run every engine on.

    python -m tests.support.tiny_archs OUT_DIR [MODEL_TYPE ...]

Same model type and width, same files (seeded). The sizes are the smallest that every engine's rules accept:
hidden 128 (AWQ's group 128 divides it; EXL3 wants a multiple of 128), 2 layers, 4 heads (2 KV heads), MoE with 4
experts of which 2 are routed to; the GPU engines take hidden 256 (heads of 64, what exllamav2's kernels are
built for).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from tests.support.tiny_model import make_sentencepiece_tokenizer, make_tiny_tokenizer

HIDDEN, LAYERS, HEADS, KV_HEADS, VOCAB = 128, 2, 4, 2, 1024
# The families whose releases ship a SentencePiece tokenizer.model, which llama.cpp's converter reads for them: their
# tiny checkpoints carry one (the others, the byte-level BPE)
SENTENCEPIECE = {
    "gemma",
    "gemma2",
    "phi3",
    "gemma3",
    "gemma3n_text",
    "gemma4",
    "gemma4_text",
    "ernie4_5",
    "ernie4_5_moe",
    "nemotron",
    "jamba",
    "minicpm3",
}
# The families written in bfloat16, as their releases are, where an engine reads some tensors in that type only:
# exllamav3's kernels take the gated delta nets' dt_bias (Qwen3-Next, Qwen3.5) and Nemotron-H's gated norm in bfloat16
# alone (the 2026-12-07 sittings refused them in float16). The others are written in float16.
BFLOAT16 = {"qwen3_next", "nemotron_h", "qwen3_5", "qwen3_5_moe", "qwen3_5_text", "qwen3_5_moe_text"}


# The special tokens of a family's releases that a tool looks up by name: transformers' tokenizer class adds Qwen2's and
# Qwen3.5-MoE's `<|endoftext|>` to any tokenizer.json, and llama.cpp's converter reads GLM's (zai-org's GLM-4.x and the
# families built on its tokenizer) and Solar Open's: their tiny vocabulary holds them, as the releases' does
GLM_SPECIAL = [
    "<|endoftext|>",
    "[MASK]",
    "[gMASK]",
    "[sMASK]",
    "<sop>",
    "<eop>",
    "<|system|>",
    "<|user|>",
    "<|assistant|>",
    "<|observation|>",
]
SPECIAL = {
    **dict.fromkeys(("qwen2", "qwen3_5_moe_text"), ["<|endoftext|>"]),
    **dict.fromkeys(
        ("glm", "glm4", "glm4v", "glm4_moe", "glm4_moe_lite", "glm_moe_dsa", "param2moe", "sarvam_moe"), GLM_SPECIAL
    ),
    "solar_open": ["<|startoftext|>", "<|endoftext|>", "<unk>"],
}


def make_tokenizer(model_type: str, out: Path):
    """The tests' tokenizer for a `model_type` checkpoint in `out`: SentencePiece's where its releases ship it."""
    if model_type in SENTENCEPIECE:
        return make_sentencepiece_tokenizer(out, VOCAB)
    return make_tiny_tokenizer(out, VOCAB, SPECIAL.get(model_type, []))


def sizes(model_type: str, hidden: int = HIDDEN) -> dict:
    """What a `model_type` config `hidden` wide is set to, under the names its config may have (config_for skips
    those it has not): the sizes every family shares, the mixture-of-experts ones (their names differ by family),
    then what one family names otherwise or needs besides."""
    shared = {
        "hidden_size": hidden,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "intermediate_size": 2 * hidden,
        "vocab_size": VOCAB,
        "max_position_embeddings": 4096,
        "head_dim": hidden // HEADS,
        "tie_word_embeddings": False,
        "num_local_experts": 4,
        "num_experts": 4,
        "n_routed_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": hidden,
        "shared_expert_intermediate_size": hidden,
        "n_shared_experts": 1,
        "first_k_dense_replace": 1,
        "n_group": 1,
        "topk_group": 1,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "norm_topk_prob": True,
        "moe_shared_expert_intermediate_size": hidden,
    }
    # multi-head latent attention: the low ranks as wide as the model, so group 128 divides every input, and a key
    # and a value for every head, as DeepSeek's releases have (eager attention refuses fewer)
    latent = {
        "kv_lora_rank": hidden,
        "qk_rope_head_dim": 16,
        "qk_nope_head_dim": 16,
        "v_head_dim": 32,
        "head_dim": 16,
        "num_key_value_heads": HEADS,
    }
    family = {
        "opt": {"ffn_dim": 2 * hidden, "word_embed_proj_dim": hidden},
        "gptj": {"n_inner": 2 * hidden, "rotary_dim": 16},
        # StarCoder's feed-forward 4 x hidden, as llama.cpp loads it
        "gpt_bigcode": {"n_inner": 4 * hidden, "multi_query": True},
        "mpt": {"expansion_ratio": 2},
        # llama.cpp loads Falcon's feed-forward 4 x hidden wide, as every Falcon release has it
        "falcon": {
            "new_decoder_architecture": True,
            "num_kv_heads": KV_HEADS,
            "parallel_attn": True,
            "ffn_hidden_size": 4 * hidden,
        },
        # releases without grouped-query attention, which llama.cpp loads as such (Phi-2's keys, OLMoE's key norm
        # over every head, dots.llm1's); Phi-2's feed-forward 4 x hidden, as llama.cpp loads it
        "phi": {"num_key_value_heads": HEADS, "intermediate_size": 4 * hidden},
        "olmoe": {"num_key_value_heads": HEADS},
        "dots1": {"num_key_value_heads": HEADS},
        # Cohere's Command R releases tie the output to the embedding (llama.cpp's converter maps no lm_head for them)
        "cohere": {"tie_word_embeddings": True},
        "cohere2": {"tie_word_embeddings": True},
        # llama.cpp loads ERNIE 4.5-MoE's shared experts intermediate_size / num_key_value_heads wide, which is what
        # ERNIE-4.5-21B-A3B's are (12288 / 4 = 2 x 1536)
        "ernie4_5_moe": {"moe_num_shared_experts": 1},
        # DeepSeek-V2-Lite's: no low rank for the query, and its 27 layers, by which llama.cpp knows a V2-Lite (it asks
        # any other DeepSeek-V2 for the query's low rank)
        "deepseek_v2": {**latent, "q_lora_rank": None, "topk_method": "greedy", "num_hidden_layers": 27},
        "deepseek_v3": {**latent, "q_lora_rank": hidden},
        "deepseek_v32": {**latent, "q_lora_rank": hidden},
        "glm_moe_dsa": {**latent, "q_lora_rank": hidden},
        # the other families with multi-head latent attention (GLM-4.7-Flash, MiniCPM3, Sarvam-M's MLA, Youtu-LLM),
        # as DeepSeek's: a key and a value for every head
        **dict.fromkeys(("glm4_moe_lite", "minicpm3", "sarvam_mla", "youtu"), {**latent, "q_lora_rank": hidden}),
        # LiquidAI's LFM2 releases tie the output to the embedding (llama.cpp's converter maps no lm_head for them)
        "lfm2": {"layer_types": ["conv", "full_attention"], "tie_word_embeddings": True},
        "lfm2_moe": {"layer_types": ["conv", "full_attention"], "tie_word_embeddings": True},
        # Mamba-2's heads times their width must be the expanded width (2 x hidden); the hybrids' releases put
        # attention among the Mamba layers (Bamba-9B at 9, 18, 27; Jamba every 8th from the 4th; Granite 4.0-H one
        # in 10), where transformers' defaults leave two layers none: the tiny ones keep one of each kind
        "granitemoehybrid": {
            "mamba_n_heads": 8,
            "mamba_d_head": 2 * hidden // 8,
            "mamba_d_state": 16,
            "layer_types": ["linear_attention", "full_attention"],
        },
        "bamba": {"mamba_n_heads": 8, "mamba_d_head": 2 * hidden // 8, "mamba_d_state": 16, "attn_layer_indices": [1]},
        "jamba": {"attn_layer_period": 2, "attn_layer_offset": 1},
        # microsoft's BitNet release ties its output to the embedding
        "bitnet": {"tie_word_embeddings": True},
        "llama4_text": {"intermediate_size_mlp": 2 * hidden},
        # Gemma 4's global layer (the last of the two) with heads twice as wide as its sliding ones (google's: 512 and
        # 256), no experts and no per-layer input embeddings: the dense gemma-4-31B's form (the E2B and E4B ones have
        # per-layer inputs, which exllamav3 does not take)
        "gemma4_text": {
            "num_experts": None,
            "moe_intermediate_size": None,
            "per_layer_config": {LAYERS - 1: {"head_dim": 2 * hidden // HEADS}},
            "hidden_size_per_layer_input": 0,
        },
        # Gemma 3n's per-layer input embeddings over the tiny vocabulary, 256 wide as its releases' (llama.cpp knows
        # no other width), and no layer reading another's keys and values (its releases' last 10 of 30 layers do: two
        # layers cannot)
        "gemma3n_text": {
            "intermediate_size": [2 * hidden] * LAYERS,  # a width per layer, as its releases say it
            "vocab_size_per_layer_input": VOCAB,
            "hidden_size_per_layer_input": 256,
            "num_kv_shared_layers": 0,
        },
        # JetBrains' Mellum2 releases interleave sliding-window layers with global ones (transformers' defaults leave
        # every layer global beside a sliding_window, which llama.cpp refuses)
        "mellum": {"layer_types": ["sliding_attention", "full_attention"]},
        # every kind of layer a release has (Mamba-2, experts, attention: NVIDIA-Nemotron-3-Nano's "MEMEM*E..."),
        # which two layers cannot hold
        "nemotron_h": {"layers_block_type": ["linear_attention", "moe", "full_attention", "moe"]},
    }
    return {**shared, **family.get(model_type, {})}


def config_for(model_type: str, bos: int, eos: int, hidden: int = HIDDEN):
    from transformers import AutoConfig

    config = AutoConfig.for_model(model_type)
    mapped = getattr(config, "attribute_map", {})
    _per_layer(config, getattr(config, "num_hidden_layers", None))
    for key, value in sizes(model_type, hidden).items():
        if key in mapped or _has(config, key):
            try:
                setattr(config, key, value)
            except AttributeError:  # a property computed from the others (Falcon's head_dim)
                pass
    config.bos_token_id, config.eos_token_id = bos, eos
    if getattr(config, "pad_token_id", None) is not None and config.pad_token_id >= VOCAB:
        config.pad_token_id = None
    return config


def _has(config, key: str) -> bool:
    """The config has `key` (Gemma 4's has head_dim as the layers' own, per_layer_config saying where a layer's
    differs, and raises on reading it whole)."""
    try:
        return hasattr(config, key)
    except RuntimeError:
        return True


def _per_layer(config, layers: int | None) -> None:
    """Cut what a config says once per layer (layer_types, mlp_layer_types, a hybrid pattern, heads per layer) to
    LAYERS entries, repeating the kinds it had in their order so both kinds of a hybrid stay."""
    if not layers:
        return
    for key, value in list(vars(config).items()):
        per_layer = isinstance(value, list) or (isinstance(value, str) and "pattern" in key)
        if per_layer and len(value) == layers and not key.startswith("_"):
            kinds = list(dict.fromkeys(value))
            cut = [kinds[i % len(kinds)] for i in range(LAYERS)]
            try:
                setattr(config, key, "".join(cut) if isinstance(value, str) else cut)
            except (AttributeError, TypeError, ValueError):
                pass


# Nemotron-H's layer kinds as its releases spell them (hybrid_override_pattern, one letter a layer)
NEMOTRON_LETTERS = {"linear_attention": "M", "full_attention": "*", "mlp": "-", "moe": "E"}


def _qwen3_moe(cfg: dict) -> dict:
    """Qwen/Qwen3-30B-A3B's config.json says num_experts (transformers 5.24 saves num_local_experts)."""
    return {"num_experts": cfg.pop("num_local_experts")}


def _exaone4(cfg: dict) -> dict:
    """LGAI-EXAONE/EXAONE-4.0-32B's says sliding_window_pattern as letters ("LLLG": L a sliding layer, G a global
    one); transformers 5.24 saves a number."""
    return {"sliding_window_pattern": "".join("L" if t == "sliding_attention" else "G" for t in cfg["layer_types"])}


def _nemotron_h(cfg: dict) -> dict:
    """nvidia's Nemotron-H releases say hybrid_override_pattern ("M-M*-E...") and num_hidden_layers; transformers
    5.24 saves layers_block_type in its own words (and an MTP pattern a release without MTP layers lacks)."""
    mtp = cfg.pop("mtp_layers_block_type", None)
    pattern = "".join(NEMOTRON_LETTERS[t] for t in cfg.pop("layers_block_type"))
    written = {"hybrid_override_pattern": pattern, "num_hidden_layers": len(pattern)}
    if cfg.get("num_nextn_predict_layers") and mtp:
        written["mtp_hybrid_override_pattern"] = "".join(NEMOTRON_LETTERS[t] for t in mtp)
    return written


def _granitemoehybrid(cfg: dict) -> dict:
    """ibm-granite/granite-4.0-h-tiny's config.json says layer_types in its own words ("mamba", "attention", which
    llama.cpp's converter reads); transformers 5 saves "linear_attention" and "full_attention"."""
    words = {"linear_attention": "mamba", "full_attention": "attention"}
    return {"layer_types": [words.get(t, t) for t in cfg["layer_types"]]}


def _qwen3_next(cfg: dict) -> dict:
    """Qwen/Qwen3-Next-80B-A3B's config.json says full_attention_interval (4: each fourth layer full attention), which
    exllamav3 reads (its default 4 made the tiny's second layer a linear one, 2026-12-07); transformers 5 saves
    layer_types alone."""
    return {"full_attention_interval": cfg["layer_types"].index("full_attention") + 1}


def _gemma4_text(text: dict) -> dict:
    """google's gemma-4-31B says its global layers' head width as global_head_dim (512 beside head_dim 256), which
    exllamav3 reads (without it, the tiny's global q_proj did not fit its 2026-12-07 sitting); transformers 5.25
    saves per_layer_config."""
    widths = {layer["head_dim"] for layer in (text.get("per_layer_config") or {}).values() if "head_dim" in layer}
    return {"global_head_dim": widths.pop()} if len(widths) == 1 else {}


def _falcon_h1(cfg: dict) -> dict:
    """tiiuae's Falcon-H1 releases say head_dim (transformers 5.24 saves none; llama.cpp's converter reads it)."""
    return {"head_dim": cfg["hidden_size"] // cfg["num_attention_heads"]}


def _gpt2(cfg: dict) -> dict:
    """openai-community/gpt2's config.json says n_ctx beside n_positions, which llama.cpp's converter reads;
    transformers 5 saves no n_ctx."""
    return {"n_ctx": cfg["n_positions"]}


def _gpt_neox(cfg: dict) -> dict:
    """EleutherAI's Pythia and GPT-NeoX releases say rotary_pct and rotary_emb_base, which llama.cpp's converter reads;
    transformers 5 saves them inside rope_parameters."""
    rope = cfg["rope_parameters"]
    return {"rotary_pct": rope["partial_rotary_factor"], "rotary_emb_base": rope["rope_theta"]}


def _cohere2(cfg: dict) -> dict:
    """CohereLabs' Command R7B config.json says rotary_pct (1.0: every dimension rotated, as transformers' Cohere2
    does), which llama.cpp's converter reads; transformers 5 saves none."""
    return {"rotary_pct": 1.0}


def _dots1(cfg: dict) -> dict:
    """rednote-hilab/dots.llm1's config.json says scoring_func "noaux_tc" (exllamav3 checks it; the pinned llama.cpp's
    converter knows no such gating and refuses it); transformers 5 saves none."""
    return {"scoring_func": "noaux_tc"}


def _glm4_moe_lite(cfg: dict) -> dict:
    """zai-org's GLM-4.7-Flash config.json says first_k_dense_replace (its dense layers before the experts), which
    llama.cpp reads; transformers 5 saves mlp_layer_types and a null."""
    kinds = cfg["mlp_layer_types"]
    return {"first_k_dense_replace": next((i for i, kind in enumerate(kinds) if kind != "dense"), len(kinds))}


def _minimax_m2(cfg: dict) -> dict:
    """MiniMaxAI's MiniMax-M2 config.json says its partial rotary embedding as rotary_dim (transformers' own config
    class says so) and its experts' sigmoid routing as scoring_func, both of which llama.cpp's converter reads;
    transformers 5 saves a partial_rotary_factor (nothing for a full one) and no scoring_func (its MiniMax-M2 routes by
    sigmoid alone)."""
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    rotary = int(head_dim * cfg["rope_parameters"].get("partial_rotary_factor", 1.0))
    return {"rotary_dim": rotary, "scoring_func": "sigmoid"}


def _own_architecture(name: str, **release):
    """Sarvam-MoE's and Param2-MoE's releases name their own class (SarvamMoEForCausalLM, Param2MoEForCausalLM, with
    their modeling code) and their own keys (transformers' SarvamMoEConfig.attribute_map: "Names used by the original
    `sarvamai/sarvam-30b` config"); transformers runs both as GLM-4-MoE and saves `Glm4MoeForCausalLM` with GLM's
    keys, which llama.cpp's converter would take for GLM's own layout (their `gate.expert_bias` then loses the
    `.bias` llama.cpp loads). `release`: keys the release writes that transformers' class has no field for."""

    def written(cfg: dict) -> dict:
        for ours, theirs in (("n_routed_experts", "num_experts"), ("n_shared_experts", "num_shared_experts"),
                             ("attention_bias", "use_qkv_bias")):  # fmt: skip
            cfg[theirs] = cfg.pop(ours)
        return {"architectures": [name], **release}

    return written


# model type -> what its release's config.json says where transformers' save_pretrained writes otherwise (a
# vision-language release's text_config too, by its language model's type: tiny_vlms.py): exllamav3 reads the
# releases' form (tests/integration/test_exl3_checkpoints.py reads each checkpoint with exllamav3's own
# classes)
RELEASE = {
    "gpt2": _gpt2,
    "gpt_neox": _gpt_neox,
    "cohere2": _cohere2,
    "dots1": _dots1,
    "glm4_moe_lite": _glm4_moe_lite,
    "minimax_m2": _minimax_m2,
    "qwen3_moe": _qwen3_moe,
    "qwen3_next": _qwen3_next,
    "gemma4_text": _gemma4_text,
    "exaone4": _exaone4,
    "nemotron_h": _nemotron_h,
    "falcon_h1": _falcon_h1,
    "granitemoehybrid": _granitemoehybrid,
    "sarvam_moe": _own_architecture("SarvamMoEForCausalLM", score_function="sigmoid"),  # sarvam-30b's router
    "param2moe": _own_architecture("Param2MoEForCausalLM"),
}


def as_released(model_type: str, config_path: Path) -> None:
    """Rewrite a saved config.json as the family's release writes it: rope_theta beside rope_parameters
    (transformers 5 writes only the latter; exllamav2 reads the former) and the family's RELEASE keys."""
    cfg = json.loads(config_path.read_text())
    theta = (cfg.get("rope_parameters") or {}).get("rope_theta")
    if theta is not None:
        cfg.setdefault("rope_theta", theta)
    if model_type in RELEASE:
        cfg.update(RELEASE[model_type](cfg))
    config_path.write_text(json.dumps(cfg, indent=2))


def make_tiny(model_type: str, out: Path, seed: int = 0, hidden: int = HIDDEN) -> Path:
    """A tiny random checkpoint of `model_type` (FP16 weights, BF16 for BFLOAT16; the tests' tokenizer), `hidden`
    wide, in `out`."""
    import torch
    from transformers import AutoModelForCausalLM

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = make_tokenizer(model_type, out)
    config = config_for(model_type, tokenizer.bos_token_id, tokenizer.eos_token_id, hidden)
    if getattr(config, "text_config", None) is not None:
        # the sizes above are the top level's: the text model inside would be built at full size (Qwen3.5's: 22 GB)
        raise ValueError(f"{model_type}'s config nests its language model (text_config): a tiny one is not made here")
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).to(torch.bfloat16 if model_type in BFLOAT16 else torch.float16)
    model.save_pretrained(out)
    as_released(model_type, out / "config.json")
    return out


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("model_types", nargs="+")
    args = parser.parse_args()
    for mt in args.model_types:
        try:
            print(make_tiny(mt, args.out / mt))
        except Exception as e:  # noqa: BLE001  (a survey: say which and go on)
            print(f"{mt}: {type(e).__name__}: {e}")
