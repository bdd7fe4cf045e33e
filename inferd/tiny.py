"""A tiny random checkpoint, seeded: what tests, the demo and benchmarks run.

It is a real Hugging Face directory (config.json, model.safetensors,
tokenizer.json, tokenizer_config.json) that `transformers` loads too, so
kvpool's paged decoder can be checked against it on identical weights, and its
chat template against `apply_chat_template`. The tokenizer is a byte-level BPE
trained here on a short embedded text: any string encodes, nothing downloads.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

ARCH_CLASSES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "mistral": "MistralForCausalLM"}

CORPUS = """\
kvpool keeps the keys and values of every earlier token in one shared pool of fixed-size blocks.
A chat turn reuses the cache of the turns before it, so the second question costs only its own tokens.
The memory manager hands out block ids, counts references, shares prefixes and swaps cold sessions out.
Workers run the model, write keys and values straight into their blocks and ask for pages once per step.
When a worker crashes its sequences are parked; another worker resumes them and nothing is recomputed.
Hello! How are you today? I am fine, thank you. What is the capital of France? Paris is the capital.
Tell me a story about a cat who learned to fly over the mountains and came home before the winter.
The quick brown fox jumps over the lazy dog. 0123456789 + - * / = ( ) [ ] { } < > , . ; : ' " ! ?
Once upon a time there was a small model with four layers that answered questions very quickly.
Systems that serve language models care about time to first token, time per output token and memory.
"""


# Zephyr-style, with plain-text role markers: the tiny vocabulary has no special
# tokens for roles, and any role (developer, tool) renders without a branch per
# role. Block tags sit on lines of their own, which trim_blocks (Hugging Face
# always turns it on) drops from the output; `{%-` also drops the newline after
# bos_token, which trim_blocks leaves since it follows a `{{ }}`.
CHAT_TEMPLATE = """\
{{ bos_token }}
{%- for message in messages %}
<|{{ message['role'] }}|>
{{ message['content'] }}{{ eos_token }}
{% endfor %}
{% if add_generation_prompt %}
<|assistant|>
{% endif %}
"""


def train_tokenizer(vocab_size: int) -> object:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<s>", "</s>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(CORPUS.splitlines() * 4, trainer=trainer)
    # The short corpus yields a few hundred merges; made-up words fill the rest of
    # the vocabulary so that every id a random model picks decodes to some text.
    missing = vocab_size - tokenizer.get_vocab_size()
    if missing > 0:
        tokenizer.add_tokens([" " + _pseudo_word(i) for i in range(missing)])
    return tokenizer


def _pseudo_word(i: int) -> str:
    consonants, vowels, word = "bcdfghklmnprstvz", "aeiou", ""
    for _ in range(3):
        word += consonants[i % 16] + vowels[(i // 16) % 5]
        i //= 80
    return word


# The demo's checkpoint, and `inferd make-tiny-model`'s by default: big enough for a chat template and a
# ~500-token system prompt, small enough to build and serve in seconds on a CPU.
DEMO_SHAPE = {"arch": "llama", "layers": 4, "hidden": 256, "heads": 8, "kv_heads": 4, "vocab": 4096}


def make_tiny_model(out: Path, *, arch: str = "llama", seed: int = 0, hidden: int = 64, layers: int = 2,
                    heads: int = 4, kv_heads: int = 2, intermediate: int | None = None, vocab: int = 512,
                    dtype: str = "float32", rope_theta: float = 10000.0, llama3_rope: bool = False) -> Path:
    """Write a seeded random checkpoint to `out` and return it."""
    from safetensors.torch import save_file

    if arch not in ARCH_CLASSES:
        raise ValueError(f"unknown architecture {arch!r}: choose from {', '.join(ARCH_CLASSES)}")
    if hidden % heads or heads % kv_heads:
        raise ValueError("hidden must divide by heads, and heads by kv_heads")
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = train_tokenizer(vocab)
    vocab = tokenizer.get_vocab_size()
    tokenizer.save(str(out / "tokenizer.json"))
    # The generic class uses tokenizer.json as it is; without tokenizer_class AutoTokenizer
    # picks one by config.json's model_type, and a Llama class expects a sentencepiece vocabulary.
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
        "chat_template": CHAT_TEMPLATE, "model_max_length": 4096, "clean_up_tokenization_spaces": False,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n")
    head_dim = hidden // heads
    intermediate = intermediate or hidden * 2
    tie = arch == "qwen2"
    config = {
        "architectures": [ARCH_CLASSES[arch]], "model_type": arch, "vocab_size": vocab, "hidden_size": hidden,
        "intermediate_size": intermediate, "num_hidden_layers": layers, "num_attention_heads": heads,
        "num_key_value_heads": kv_heads, "head_dim": head_dim, "hidden_act": "silu", "rms_norm_eps": 1e-6,
        "max_position_embeddings": 4096, "rope_theta": rope_theta, "tie_word_embeddings": tie,
        "torch_dtype": dtype, "bos_token_id": tokenizer.token_to_id("<s>"),
        "eos_token_id": tokenizer.token_to_id("</s>"),
    }
    if llama3_rope:
        config["rope_scaling"] = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                  "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    if arch == "mistral":
        config["sliding_window"] = None
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")

    gen = torch.Generator().manual_seed(seed)
    # Larger than a trained model's init so that logits are peaked: greedy choices
    # then do not hinge on the last bit of a float, and two implementations agree.
    rand = lambda *shape, std=0.08: torch.randn(*shape, generator=gen) * std  # noqa: E731
    weights = {"model.embed_tokens.weight": rand(vocab, hidden, std=1.0), "model.norm.weight": 1 + rand(hidden)}
    if not tie:
        weights["lm_head.weight"] = rand(vocab, hidden, std=0.2)
    for i in range(layers):
        p = f"model.layers.{i}."
        weights |= {
            p + "input_layernorm.weight": 1 + rand(hidden),
            p + "post_attention_layernorm.weight": 1 + rand(hidden),
            p + "self_attn.q_proj.weight": rand(heads * head_dim, hidden, std=0.2),
            p + "self_attn.k_proj.weight": rand(kv_heads * head_dim, hidden, std=0.2),
            p + "self_attn.v_proj.weight": rand(kv_heads * head_dim, hidden),
            p + "self_attn.o_proj.weight": rand(hidden, heads * head_dim),
            p + "mlp.gate_proj.weight": rand(intermediate, hidden),
            p + "mlp.up_proj.weight": rand(intermediate, hidden),
            p + "mlp.down_proj.weight": rand(hidden, intermediate),
        }
        if arch == "qwen2":
            weights |= {p + f"self_attn.{n}_proj.bias": rand(size, std=0.1)
                        for n, size in (("q", heads * head_dim), ("k", kv_heads * head_dim),
                                        ("v", kv_heads * head_dim))}
    torch_dtype = getattr(torch, dtype)
    save_file({k: v.to(torch_dtype).contiguous() for k, v in weights.items()}, str(out / "model.safetensors"))
    # Readable by whoever serves it, like any checkpoint (the service user is not the one who made it):
    # safetensors writes its file 0600.
    for name in ("tokenizer.json", "tokenizer_config.json", "config.json", "model.safetensors"):
        (out / name).chmod(0o644)
    return out
