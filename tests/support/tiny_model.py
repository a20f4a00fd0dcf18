"""A tiny seeded random Llama with a real BPE tokenizer, made on the spot (no hub).

    python -m tests.support.tiny_model OUT_DIR [--hidden 128] [--layers 2]

The tokenizer is a byte-level BPE trained on exllamav2's builtin c4 text, so calibration and evaluation
text tokenize the way they would for a real model. Same arguments, same files (seeded).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from calibration import builtin_text

# The random 1.1B Llama of docs/measured.md (make_tiny_llama(out, device="cuda", **LLAMA_1B): seconds on a GPU).
LLAMA_1B = dict(
    hidden=2048,
    layers=16,
    heads=32,
    kv_heads=8,
    intermediate=8192,
    vocab=32000,
    max_positions=32768,
    rope_theta=500000.0,
)


def make_tiny_tokenizer(out: Path, vocab: int = 1024, special: list[str] = ()):
    """A byte-level BPE of `vocab` tokens (<s>, </s> and `special`) trained on the builtin c4 text, saved in `out`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE(unk_token=None))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab, special_tokens=["<s>", "</s>", *special], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    bpe.train_from_iterator(builtin_text("c4").splitlines(), trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token="<s>", eos_token="</s>")
    tokenizer.save_pretrained(out)
    return tokenizer


def make_sentencepiece_tokenizer(out: Path, vocab: int = 1024):
    """A SentencePiece BPE of `vocab` pieces (<unk>, <s>, </s>, the 256 bytes, merges) trained on the builtin c4 text,
    saved in `out` as the SentencePiece families' releases ship it: tokenizer.model beside the tokenizer.json made
    from it. No normalization and no dummy prefix (as Gemma's), so both give the same ids for any text."""
    import io

    import sentencepiece
    from transformers import LlamaTokenizer
    from transformers.tokenization_utils_sentencepiece import SentencePieceExtractor

    out.mkdir(parents=True, exist_ok=True)
    model = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(builtin_text("c4").splitlines()),
        model_writer=model,
        vocab_size=vocab,
        model_type="bpe",
        byte_fallback=True,
        unk_id=0,
        bos_id=1,
        eos_id=2,
        pad_id=-1,
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        add_dummy_prefix=False,
        max_sentence_length=1 << 20,  # c4's lines are whole documents; the default drops those over 4 KiB
        num_threads=1,
        minloglevel=2,
    )
    (out / "tokenizer.model").write_bytes(model.getvalue())
    pieces, _, merges = SentencePieceExtractor(str(out / "tokenizer.model")).extract()
    tokenizer = LlamaTokenizer(vocab=pieces, merges=merges, add_prefix_space=False, add_bos_token=False)
    tokenizer.save_pretrained(out)
    return tokenizer


def make_tiny_llama(
    out: Path,
    *,
    hidden: int = 128,
    layers: int = 2,
    seed: int = 0,
    heads: int = 4,
    kv_heads: int = 2,
    intermediate: int | None = None,
    vocab: int = 1024,
    max_positions: int = 4096,
    rope_theta: float = 10000.0,
    device: str = "cpu",
) -> Path:
    """Defaults: the tests' tiny model; LLAMA_1B the 1.1B one."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = make_tiny_tokenizer(out, vocab)

    config = LlamaConfig(
        vocab_size=vocab,  # the trained tokenizer may have fewer tokens; the model keeps the shape asked for
        hidden_size=hidden,
        intermediate_size=intermediate or hidden * 2,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=max_positions,
        rope_theta=rope_theta,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(seed)
    with torch.device(device):
        model = LlamaForCausalLM(config).to(torch.float16)
    if device == "meta":
        config.architectures, config.dtype = [type(model).__name__], "float16"  # as save_pretrained writes them
        config.save_pretrained(out)
        save_headers(model.state_dict(), out / "model.safetensors")
    else:
        model.save_pretrained(out)
    # transformers 5 writes rope_parameters; exllamav2 reads rope_theta.
    cfg_path = out / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.setdefault("rope_theta", rope_theta)
    cfg_path.write_text(json.dumps(cfg, indent=2))
    return out


def save_headers(tensors: dict, path: Path) -> None:
    """A safetensors file whose header is real and whose data is a hole: `qf plan` of a large shape on any machine
    (it reads configs and headers only), at no disk cost."""
    header, offset = {}, 0
    for name, t in tensors.items():
        size = t.numel() * t.element_size()
        header[name] = {"dtype": "F16", "shape": list(t.shape), "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little") + raw)
        f.truncate(8 + len(raw) + offset)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    args = parser.parse_args()
    print(make_tiny_llama(args.out, hidden=args.hidden, layers=args.layers))
