"""Test helpers shared by the test files: tiny random Hugging Face checkpoints built with
transformers (the reference implementation), with EVERY parameter randomised, because HF's
default init (zero biases, unit norm weights) hides whole classes of bugs (a dropped q/k/v bias
matches to 0.0, interleaved RoPE to ~5e-3)."""

import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import torch

FAMILIES = ("llama", "qwen2", "qwen3")  # the hybrid qwen3_5 has its own tests (test_qwen35.py)
QWEN35_PATTERN = ["linear_attention"] * 3 + ["full_attention"]  # the published checkpoints' [L, L, L, F] repeat
# Qwen3.5-0.8B's published text model (model.ModelConfig fields; docs/real-models.md)
QWEN35_08B = dict(vocab_size=248320, hidden_size=1024, intermediate_size=3584, num_hidden_layers=24,
                  num_attention_heads=8, num_key_value_heads=2, head_dim=256, rope_theta=1e7, tie_word_embeddings=True,
                  qk_norm=True, model_type="qwen3_5", layer_types=tuple(QWEN35_PATTERN * 6), partial_rotary_factor=0.25,
                  linear_num_key_heads=16, linear_num_value_heads=16, linear_key_head_dim=128,
                  linear_value_head_dim=128, max_position_embeddings=262144, torch_dtype="bfloat16")  # fmt: skip


def make_hf_model(
    family: str,
    tied: bool = False,
    *,
    vocab_size: int = 128,
    hidden_size: int = 64,
    intermediate_size: int = 128,
    num_hidden_layers: int | None = None,  # 2, and 4 (one [L, L, L, F]) for qwen3_5
    num_attention_heads: int = 4,
    num_key_value_heads: int = 2,
    head_dim: int | None = None,
    seed: int = 0,
    **config_kw,
):
    """A tiny transformers *ForCausalLM in float32 and eval mode, every parameter randomised
    (weights and biases N(0, 0.05), norm weights 1 + 0.1 N(0, 1)). family: llama (Llama 3 with
    llama3 RoPE scaling, rope_theta 5e5) | qwen2 (q/k/v bias) | qwen3 (q/k norm, explicit head_dim) | qwen3_5
    (Qwen3.5's hybrid: num_hidden_layers in the [L, L, L, F] pattern, partial rotary 0.25, its zero-centred norm
    weights 0.1 N(0, 1), A_log over the published range)."""
    import transformers

    kw = dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_hidden_layers or (4 if family == "qwen3_5" else 2),
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads,
        tie_word_embeddings=tied,
        max_position_embeddings=256,
        bos_token_id=1,
        eos_token_id=2,
    )
    if family == "llama":
        # a small original context (64) puts the head_dim-16 frequencies in all three llama3 bands
        kw |= dict(
            rms_norm_eps=1e-5,
            rope_theta=500000.0,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        )
        cls, model_cls = transformers.LlamaConfig, transformers.LlamaForCausalLM
    elif family == "qwen2":
        kw |= dict(rope_theta=1000000.0)
        cls, model_cls = transformers.Qwen2Config, transformers.Qwen2ForCausalLM
    elif family == "qwen3":
        kw |= dict(rope_theta=1000000.0, head_dim=head_dim or 32)  # != hidden / heads = 16
        cls, model_cls = transformers.Qwen3Config, transformers.Qwen3ForCausalLM
    elif family == "qwen3_5":
        L = kw["num_hidden_layers"]
        kw |= dict(head_dim=head_dim or 32, layer_types=(QWEN35_PATTERN * L)[:L])
        kw |= dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=8)
        kw["rope_parameters"] = {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25}
        cls, model_cls = transformers.Qwen3_5TextConfig, transformers.Qwen3_5ForCausalLM
    else:
        raise ValueError(f"unknown family {family!r}")
    if head_dim is not None:
        kw["head_dim"] = head_dim
    model = model_cls(cls(**(kw | config_kw)))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            p.copy_(1 + 0.1 * noise if "norm" in name else 0.05 * noise)
            if family == "qwen3_5" and "norm" in name and "linear_attn" not in name:
                p.copy_(0.1 * noise)  # x * (1 + w)
            if name.endswith("A_log"):
                p.copy_(torch.empty(p.shape).uniform_(0.01, 16, generator=g).log())  # transformers' init range
    return model.float().eval()


def make_hf_checkpoint(
    tmp_path: Path, family: str, tied: bool = False, *, max_shard_size: str | None = None, name: str | None = None, **kw
) -> Path:
    """Save make_hf_model(family, tied, **kw) with save_pretrained into tmp_path/name and return
    that directory (max_shard_size, e.g. "20KB", gives a sharded checkpoint with an index)."""
    path = Path(tmp_path) / (name or f"{family}-{'tied' if tied else 'untied'}")
    model = make_hf_model(family, tied, **kw)
    extra = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(path, **extra)
    return path


def hf_logits(path: Path, input_ids: torch.Tensor) -> torch.Tensor:
    """Reference logits: transformers loads `path` itself (float32, eval)."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(input_ids).logits


class CatCache:
    """The smallest cache that follows model.py's protocol: per layer, append the new keys and
    values along the sequence axis and return everything so far. Tests use it to check the model
    side of caching independently of sampler.py's preallocated cache."""

    def __init__(self):
        self.k: dict[int, torch.Tensor] = {}
        self.v: dict[int, torch.Tensor] = {}

    def update(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if layer_idx in self.k:
            k, v = torch.cat([self.k[layer_idx], k], dim=2), torch.cat([self.v[layer_idx], v], dim=2)
        self.k[layer_idx], self.v[layer_idx] = k, v
        return k, v

    @property
    def length(self) -> int:
        return self.k[0].shape[2] if self.k else 0


def bottom_right_causal(B: int, T: int, S: int) -> torch.Tensor:
    """(B, 1, T, S) bool mask for T new queries after S - T cached keys: query t sees keys <= S-T+t."""
    rows = torch.arange(T)[:, None]
    cols = torch.arange(S)[None, :]
    return (cols <= (S - T) + rows).expand(B, 1, T, S)


def make_char_tokenizer(
    path: Path, chars: str = "0123456789+-*/=() abcdefghijklmnopqrstuvwxyz.,:?\n", thinking: bool = True
) -> Path:
    """A character-level tokenizer.json like the bundled tiny model's: WordLevel over single
    characters, a decoder that joins without spaces, Qwen specials (<|endoftext|>, <|im_start|>,
    <|im_end|>) and, like Qwen3, <think> / </think> as added but not special tokens."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    vocab = {c: i for i, c in enumerate(["<unk>", *dict.fromkeys(chars)])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("(?m:.)"), behavior="isolated")  # (?m) = dot-all
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    if thinking:
        tok.add_tokens(["<think>", "</think>"])
    Path(path).mkdir(parents=True, exist_ok=True)
    tok.save(str(Path(path) / "tokenizer.json"))
    return Path(path)


QWEN_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
LLAMA3_SPECIALS = [
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eom_id|>",
    "<|eot_id|>",
]
CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "2+2=4 and 3*3=9; café, naïve, 東京.",
    "def f(x):\n    return x * 2\n",
    "Think step by step, then answer.",
] * 4


def make_bpe_tokenizer(path: Path, family: str, vocab_size: int = 400) -> Path:
    """A small ByteLevel BPE trained on a few strings, with the family's special tokens:
    qwen2 (ChatML), qwen3 (ChatML + <think> / </think> as added, non-special tokens) or llama3
    (header tokens, and a TemplateProcessing post-processor that prepends <|begin_of_text|>
    exactly like the real Llama 3 tokenizer.json, to expose double-BOS bugs)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    specials = LLAMA3_SPECIALS if family == "llama3" else QWEN_SPECIALS
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(CORPUS, trainer)
    if family == "qwen3":
        tok.add_tokens(["<think>", "</think>"])
    if family == "llama3":
        bos = tok.token_to_id("<|begin_of_text|>")
        tok.post_processor = processors.TemplateProcessing(
            single="<|begin_of_text|> $A",
            pair="<|begin_of_text|> $A <|begin_of_text|> $B",
            special_tokens=[("<|begin_of_text|>", bos)],
        )
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    Path(path).mkdir(parents=True, exist_ok=True)
    tok.save(str(Path(path) / "tokenizer.json"))
    return Path(path)


BUNDLED = str(Path(__file__).resolve().parents[1] / "assets" / "tiny-model")  # trained: mixed rewards
# A few-second run of train.py on the bundled model: 4 prompts x 4 completions, short, one small eval.
SMALL_RUN = dict(model=BUNDLED, max_steps=2, prompts_per_step=4, thoughts=4, answers=1, max_thought_tokens=12,
                 max_answer_tokens=6, eval_every=0, eval_examples=8, eval_samples=2)  # fmt: skip


def make_hybrid_run_checkpoint(tmp_path: Path) -> str:
    """A tiny tied Qwen3.5 hybrid with the bundled tiny model's tokenizer (vocabulary 28): a train.py run's --model."""
    import shutil

    path = make_hf_checkpoint(tmp_path, "qwen3_5", tied=True, vocab_size=28, name="hybrid")
    for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(f"{BUNDLED}/{f}", path / f)
    return str(path)


class ScriptedEnv:
    """A user's environment (envs.Env): a turn ends at `stop`; the observation is `observation` twice (the second
    call counted as an error), then the completion is done with reward 1."""

    def __init__(self, stop: str = "m", observation: str = "ok") -> None:
        self.stop, self.observation = stop, observation
        self.errors, self.seconds, self.turns = 0, 0.0, 0

    def reset(self, example: dict) -> str:
        return example["prompt"]

    def step(self, text: str) -> tuple[str | None, float, bool]:
        self.turns += 1
        self.errors += self.turns == 2
        return (self.observation, 0.5, False) if self.turns < 3 else (None, 1.0, True)


@contextlib.contextmanager
def lock_held_elsewhere(path: str) -> Iterator[subprocess.Popen]:
    """Another process holding checkpoint.hold_lock on `path` for the block; killed with SIGKILL at its end
    (the kernel then releases the lock: no stale lock survives a killed process)."""
    root = Path(__file__).resolve().parents[1]
    script = f"import checkpoint, time; checkpoint.hold_lock({path!r}, 'x'); print('held', flush=True); time.sleep(600)"
    holder = subprocess.Popen([sys.executable, "-c", script], cwd=root, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "held\n"
        yield holder
    finally:
        holder.kill()
        holder.wait()


def count_compiled_steps(monkeypatch) -> list[str]:
    """torch.compile replaced by a wrapper that checks it is given the sampler's static decode step with dynamic
    shapes (one compile for every batch bucket), and records "compile" once and "step" per call (compiling itself
    takes minutes on CPU). Returns the list it appends to."""
    import torch

    import sampler

    calls = []

    def fake_compile(fn, **kw):
        assert fn is sampler.decode_step_static and kw == dict(dynamic=True, fullgraph=True)
        calls.append("compile")
        return lambda *args: calls.append("step") or fn(*args)

    monkeypatch.setattr(torch, "compile", fake_compile)
    return calls


ISA_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "avx512_fp16", "avx_vnni", "amx_tile", "amx_bf16")


def machine() -> dict:
    """The machine kind a CPU result is bit-stable on (golden runs, docs/tour.md): the torch version, the CPU
    capability torch dispatches on, the CPU vendor (its BLAS picks other kernels on AMD and Intel) and the vector
    extensions it has."""
    info = open("/proc/cpuinfo").read() if os.path.exists("/proc/cpuinfo") else ""
    vendor = next((line.split(":")[1].strip() for line in info.splitlines() if line.startswith("vendor_id")), "")
    flags = next((line.split(":")[1].split() for line in info.splitlines() if line.startswith("flags")), [])
    isa = [f for f in ISA_FLAGS if f in flags]
    return {"torch": torch.__version__, "cpu": torch.backends.cpu.get_cpu_capability(), "vendor": vendor, "isa": isa}


def tiny_transformer(family: str = "qwen2", layers: int = 2, seed: int = 0, tie: bool = False):
    """A tiny random decoder of `family` (vocabulary 128, width 64, 4 query and 2 key/value heads of 16, SwiGLU
    128), built after torch.manual_seed(seed), in eval mode: the sampler's and decode path's tests share it.
    qwen3_5: the hybrid, its layers in the [L, L, L, F] pattern (make_hf_model's shape: gated heads of 32, a
    quarter rotated; DeltaNet with 2 key heads of 16 and 4 value heads of 8)."""
    from model import ModelConfig, Transformer

    torch.manual_seed(seed)
    kw = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=4)
    kw |= dict(num_key_value_heads=2, head_dim=16, attention_bias=family == "qwen2", qk_norm=family == "qwen3")
    if family == "qwen3_5":
        kw |= dict(head_dim=32, qk_norm=True, layer_types=tuple((QWEN35_PATTERN * layers)[:layers]))
        kw |= dict(partial_rotary_factor=0.25, rope_theta=1e7, linear_num_key_heads=2, linear_num_value_heads=4)
        kw |= dict(linear_key_head_dim=16, linear_value_head_dim=8)
    return Transformer(ModelConfig(**kw, model_type=family, tie_word_embeddings=tie)).eval()
