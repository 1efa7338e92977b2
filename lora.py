"""lora.py: LoRA adapters (arXiv 2106.09685) on the transformer's linear layers, the frozen base as the
reference model, merged weights for the sampler, and adapter checkpoints in PEFT's format.

    python lora.py --merge ADAPTER_DIR --out DIR [--base MODEL_DIR] [--overwrite]  # a full HF checkpoint, merged

What it owns:
* `add_lora(model, rank, alpha, targets, seed)` replaces each target nn.Linear (q, k, v, o, gate, up, down:
  the `*_proj` layers of model.py) by a `LoRALinear`: the same frozen weight (and bias) Parameters, plus
  lora_A (r, in), kaiming-uniform as PEFT, and lora_B (out, r), zeros, so a fresh adapter changes nothing;
  y = W x + b + B (A x) * alpha / r. Every base parameter (embeddings, norms, head too) stops requiring grad.
  State-dict names of the base stay the HF ones (`...q_proj.weight`); the adapters add `...q_proj.lora_A`
  and `...q_proj.lora_B`, so `lora_parameters(model)` (the optimizer's list) is named plainly.
* The fused SwiGLU backward of model.py (MLP) runs the down adapter inside it: LoRA on down is not skipped.
* `adapters_off(model)`: forwards inside run the frozen base exactly (bit for bit the unwrapped model):
  the reference pass of the KL penalty, with no second copy of the weights.
* `merged_copy(model, dtype)` / `copy_merged_(dst, src)`: a plain Transformer holding W + (B A) * alpha / r
  for the sampler, refreshed after each update; `merged_state_dict(model)` for a full checkpoint.
* `save_adapters` / `load_adapters`: adapter_model.safetensors + adapter_config.json as PEFT writes them
  (keys `base_model.model.<module>.lora_A.weight`, in the base's layout), loaded strictly; `merge_checkpoint`, the CLI.

Merged versus unmerged weights (measured: tests/test_lora.py, bench/bench_lora.py). In exact arithmetic
W x + (B (A x)) s equals (W + (B A) s) x; in floating point they round differently, so their logits are NOT
bit-equal: at Qwen2.5-0.5B's shape (rank 16, adapters moving the logits by up to 2.6) they differed by at most
6.5e-6 in float32 and 0.07 under bf16 autocast (as much as any bf16 rounding), ~1e-6 on the tiny test models.
Tokens are what agree: greedy and seeded sampling gave the same tokens from both in every case measured
(inverse-CDF sampling with one uniform per step changes a token only when the uniform falls within ~1e-6 of
a cumulative-probability boundary, greedy only at a near-tie), log-probs within ~5e-6. Bit-exact, and tested:
adapters off == the base model; a fresh adapter (B = 0) and its merged copy == the base model; the base
weights are never modified (the merge is computed into a separate copy each time, never added and subtracted
in place, which would drift the reference: (W + D) - D != W); save/load round-trips the adapters; a refreshed
merged copy == a fresh one. So the trainer should: sample from `merged_copy` (bf16 rollouts: it replaces
model.cast_copy at the same memory; float32 rollouts may sample from the wrapped policy itself, as today) and
take old and reference log-probs from its own score pass (the policy; the policy under adapters_off), never
from the sampler, whose log-probs are already another computation (decode kernels, bf16) without LoRA.

Distributed: LoRALinear is an ordinary nn.Module (no hooks, no global state; `enabled` is a plain
attribute). Call add_lora before distributed.wrap: DDP then ignores the frozen base (it reduces only
parameters that require grad) and FSDP2's fully_shard shards base and adapters alike, reducing gradients
of the adapters only. Every rank must pass the same seed (A's init). Under FSDP2, save_adapters,
merged_state_dict and copy_merged_ gather full tensors (collectives: every rank calls them); load_adapters
runs before wrapping. adapters_off only flips attributes read at forward time, so it works on a sharded or
DDP-wrapped model; run the reference pass under no_grad, as the score pass does: with grad enabled, DDP would
report the adapters as unused parameters, and a gradient-checkpointed layer recomputed in backward after the
block would see the adapters on again. Pass the policy itself (or its DDP wrapper) to these functions.

Left out: dropout on the adapter input (RL updates are small and on-policy; PEFT's lora_dropout is saved
as 0.0 and ignored on load), rsLoRA and DoRA and per-module ranks (refused on load), adapters on the
embeddings or lm_head, bias training.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import sys
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import Tensor

from model import Transformer

DECODER = ("q", "k", "v", "o", "gate", "up", "down")  # every linear of a Llama / Qwen block: --lora-targets' default
TARGETS = {t: f"{t}_proj" for t in DECODER}  # --lora-targets name -> the model.py (and HF) module name it adapts
# a Qwen3.5 hybrid's Gated DeltaNet layers (deltanet.py): its input projections and its output
TARGETS |= {t: f"in_proj_{t}" for t in ("qkv", "z", "b", "a")} | {"out": "out_proj"}
ADAPTER_WEIGHTS, ADAPTER_CONFIG = "adapter_model.safetensors", "adapter_config.json"  # PEFT's file names
PEFT_PREFIX = "base_model.model."  # PEFT's key prefix: PeftModel -> LoraModel -> the *ForCausalLM
MULTIMODAL = PEFT_PREFIX + "model.language_model."  # ... -> Qwen3_5ForConditionalGeneration's (hf.decoder_prefix)
# adapter_config.json fields of PEFT features these adapters do not have: each must be absent or off
UNSUPPORTED = tuple(
    "use_dora use_rslora lora_bias modules_to_save layers_to_transform layers_pattern rank_pattern alpha_pattern "
    "fan_in_fan_out layer_replication trainable_token_indices target_parameters exclude_modules use_qalora "
    "alora_invocation_tokens use_bdlora".split()
)


# ----------------------------------------------------------------------------- the adapter layer


class LoRALinear(nn.Module):
    """y = F.linear(x, weight, bias) + (x A^T B^T) * scaling, weight (out, in) and bias frozen, A (r, in),
    B (out, r). With `enabled` False it is exactly nn.Linear's forward on the same weight."""

    def __init__(self, base: nn.Linear, rank: int, alpha: float, generator: torch.Generator):
        super().__init__()
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight = base.weight.requires_grad_(False)  # the same Parameter object: no copy of the base
        self.bias = None if base.bias is None else base.bias.requires_grad_(False)
        self.rank, self.alpha, self.scaling = rank, alpha, alpha / rank
        # A like PEFT's default (nn.Linear's init: kaiming-uniform, a = sqrt(5)), drawn in float32 on the CPU
        # from the caller's generator, so every device and rank gets the same values; B zeros
        a = torch.empty(rank, self.in_features)
        nn.init.kaiming_uniform_(a, a=math.sqrt(5), generator=generator)
        w = self.weight
        self.lora_A = nn.Parameter(a.to(w.device, w.dtype))
        self.lora_B = nn.Parameter(torch.zeros(self.out_features, rank, dtype=w.dtype, device=w.device))
        self.enabled = True  # False inside adapters_off

    def add_update(self, base: Tensor, z: Tensor) -> Tensor:
        """base + B z * scaling: base = W x + b (..., out), z = A x (..., r). The one place the adapter's output
        is added, also used by model.MLP's fused path, so both paths round alike."""
        return base + F.linear(z, self.lora_B) * self.scaling

    def forward(self, x: Tensor) -> Tensor:
        base = F.linear(x, self.weight, self.bias)
        return self.add_update(base, F.linear(x, self.lora_A)) if self.enabled else base

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, rank={self.rank}, alpha={self.alpha}"


def parse_targets(text: str) -> tuple[str, ...]:
    """'q,k,v,o,gate,up,down' -> ('q', 'k', ...), in TARGETS' order; an unknown or missing name is one sentence."""
    names = [t.strip() for t in text.split(",") if t.strip()]
    unknown = [t for t in names if t not in TARGETS]
    if unknown or not names:
        raise ValueError(f"--lora-targets {text!r}: expected a comma-separated subset of {','.join(TARGETS)}.")
    return tuple(t for t in TARGETS if t in names)


def adapter_size(config, rank: int, targets: Sequence[str]) -> int:
    """The adapters' parameter count for a model config: rank * (in + out) per adapted layer (the memory estimate's
    trainable parameters under LoRA), counted on the model built on the meta device."""
    with torch.device("meta"):
        model = Transformer(config)
    names = {TARGETS[t] for t in targets}
    linears = [m for n, m in model.named_modules() if n.rpartition(".")[2] in names and isinstance(m, nn.Linear)]
    return sum(rank * (m.in_features + m.out_features) for m in linears)


def add_lora(model: Transformer, rank: int, alpha: float, targets: Sequence[str], seed: int = 0) -> Transformer:
    """Wrap model's target linear layers (names of TARGETS, e.g. ('q', 'v')) with LoRALinear adapters of rank
    `rank` and scaling alpha / rank, in place, and freeze every base parameter. A is drawn from
    torch.Generator().manual_seed(seed), layer by layer in module order. Returns model."""
    if rank < 1:
        raise ValueError(f"add_lora: rank must be >= 1, got {rank}.")
    if not alpha > 0:
        raise ValueError(f"add_lora: alpha must be > 0, got {alpha}.")
    if not targets or any(t not in TARGETS for t in targets):
        raise ValueError(f"add_lora: targets {tuple(targets)} must be a non-empty subset of {tuple(TARGETS)}.")
    if lora_layers(model):
        raise ValueError("add_lora: the model already has LoRA adapters.")
    model.requires_grad_(False)
    generator = torch.Generator().manual_seed(seed)
    names = {TARGETS[t] for t in targets}
    for layer in model.model.layers:
        for parent in (getattr(layer, "self_attn", None) or layer.linear_attn, layer.mlp):  # the layer's mixer
            for name, child in list(parent.named_children()):
                if name in names:
                    setattr(parent, name, LoRALinear(child, rank, alpha, generator))
    absent = [t for t in targets if not any(n.endswith("." + TARGETS[t]) for n in lora_layers(model))]
    if absent:  # e.g. a DeltaNet projection asked of a model without DeltaNet layers: it would train nothing
        raise ValueError(f"add_lora: target {absent[0]!r} ({TARGETS[absent[0]]}) is in no layer of this model.")
    return model


def lora_layers(model: nn.Module) -> dict[str, LoRALinear]:
    """The adapter layers by module name (e.g. 'model.layers.0.self_attn.q_proj'), in module order; of a DDP
    wrapper, its module's (the names are the checkpoint's either way)."""
    return {name: m for name, m in _unwrap(model).named_modules() if isinstance(m, LoRALinear)}


def _unwrap(model: nn.Module) -> nn.Module:
    return getattr(model, "module", model)  # DDP's wrapper holds the model as .module


def lora_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The trainable parameters: every layer's lora_A and lora_B, in module order (the optimizer's list)."""
    return [p for m in lora_layers(model).values() for p in (m.lora_A, m.lora_B)]


def lora_spec(model: nn.Module) -> dict:
    """rank, alpha and targets (TARGETS names) of a wrapped model, as add_lora takes them."""
    layers = list(lora_layers(model).values())
    if not layers:
        raise ValueError("lora_spec: the model has no LoRA adapters (call add_lora first).")
    names = {name.rpartition(".")[2] for name in lora_layers(model)}
    return dict(rank=layers[0].rank, alpha=layers[0].alpha, targets=tuple(t for t, n in TARGETS.items() if n in names))


@contextlib.contextmanager
def adapters_off(model: nn.Module) -> Iterator[None]:
    """Inside the block every adapter is off: the model computes its frozen base exactly (the KL reference)."""
    layers = list(lora_layers(model).values())
    before = [m.enabled for m in layers]
    for m in layers:
        m.enabled = False
    try:
        yield
    finally:
        for m, on in zip(layers, before):
            m.enabled = on


# ----------------------------------------------------------------------------- merged weights


def _full(t: Tensor) -> Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t  # FSDP2's DTensor: all-gather (a collective)


def _merged(model: nn.Module) -> Iterator[tuple[str, Tensor]]:
    """(name, tensor) of the plain model's parameters (HF names; a tied head once, as embed_tokens), each
    adapted weight as W + (B @ A) * scaling in float32, one at a time: the caller copies or keeps them."""
    layers, model = lora_layers(model), _unwrap(model)
    for name, p in model.named_parameters():
        module, _, leaf = name.rpartition(".")
        if leaf in ("lora_A", "lora_B"):
            continue
        t = _full(p)
        if module in layers and leaf == "weight":
            m = layers[module]
            delta = _full(m.lora_B).float() @ _full(m.lora_A).float()  # (out, in)
            t = delta.mul_(m.scaling).add_(t)  # W + (B @ A) * s, in place: one (out, in) buffer, not three
        yield name, t


@torch.no_grad()
def merged_state_dict(model: nn.Module, dtype: torch.dtype | None = None) -> dict[str, Tensor]:
    """The plain model's state dict (HF names, no adapter keys) with each adapted weight replaced by
    W + (B @ A) * scaling, computed in float32 and cast to `dtype` (None: the base weight's dtype). The model
    is not modified. Under FSDP2 each tensor is gathered whole (every rank must call this)."""
    dtypes = {name: p.dtype for name, p in _unwrap(model).named_parameters()}
    return {name: t.to(dtype or dtypes[name]) for name, t in _merged(model)}


def merged_copy(model: nn.Module, dtype: torch.dtype | None = None) -> Transformer:
    """A frozen plain Transformer with the merged weights of `model` in `dtype` (None: the base's), on its
    device: the sampler's weights. Refresh it after each update with copy_merged_."""
    model = _unwrap(model)
    config = model.config
    with torch.device("meta"):
        copy = Transformer(config)
    p = next(model.parameters())
    copy = copy.to(dtype or p.dtype).to_empty(device=p.device).requires_grad_(False)
    if config.tie_word_embeddings:
        copy.lm_head.weight = copy.model.embed_tokens.weight
    return copy_merged_(copy, model)


@torch.no_grad()
def copy_merged_(dst: Transformer, src: nn.Module) -> Transformer:
    """dst's parameters := src's merged weights (merged_state_dict), cast to dst's dtype."""
    params = dict(dst.named_parameters())
    for name, t in _merged(src):  # one merged weight alive at a time
        params[name].copy_(t)
    return dst


# ----------------------------------------------------------------------------- adapter checkpoints (PEFT)


def adapter_config(model: nn.Module, base_model_path: str) -> dict:
    """adapter_config.json as PEFT reads it (its other fields take PEFT's defaults)."""
    spec = lora_spec(model)
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": str(base_model_path),
        "r": spec["rank"],
        "lora_alpha": spec["alpha"],
        "target_modules": [TARGETS[t] for t in spec["targets"]],
        "lora_dropout": 0.0,
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "init_lora_weights": True,
        "inference_mode": True,
        "modules_to_save": None,
        "layers_to_transform": None,
        "rank_pattern": {},
        "alpha_pattern": {},
    }


def _write_atomic(file: Path, write) -> None:
    """write(tmp_path), then rename it over `file`: a crash leaves the old file or the new one. The file gets the
    permissions the umask allows (mkstemp's and save_file's are 0600)."""
    from hf import plain_permissions

    fd, tmp = tempfile.mkstemp(prefix=f".{file.name}.tmp-", dir=file.parent)
    os.close(fd)
    try:
        write(Path(tmp))
        plain_permissions(tmp)
        os.replace(tmp, file)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def save_adapters(model: nn.Module, path: str | os.PathLike, base_model_path: str | os.PathLike) -> None:
    """Write adapter_model.safetensors (each adapter in its own dtype) and adapter_config.json into the
    directory `path` (created if needed; other files there are kept), as PEFT's save_pretrained does;
    `peft.PeftModel.from_pretrained(hf_model, path)` and load_adapters read it. Under FSDP2 every rank must
    call this (the adapters are gathered); only the caller decides which rank writes, so call it on all
    ranks and let rank 0 keep the files."""
    write_adapters(adapter_tensors(model, base_model_path), adapter_config(model, str(base_model_path)), path)


def adapter_tensors(model: nn.Module, base_model_path: str | os.PathLike) -> dict[str, Tensor]:
    """The adapters under PEFT's keys in the base checkpoint's layout (hf.decoder_prefix: PEFT matches them to the
    module names of the class it loads the base as), whole and on the CPU (under FSDP2 every rank calls it)."""
    from hf import decoder_prefix

    tensors, prefix = {}, PEFT_PREFIX + decoder_prefix(base_model_path)
    for name, m in lora_layers(model).items():
        for leaf in ("lora_A", "lora_B"):
            key = prefix + f"{name}.{leaf}.weight".removeprefix("model.")
            tensors[key] = _full(getattr(m, leaf)).detach().cpu().contiguous()
    return tensors


def write_adapters(tensors: dict[str, Tensor], config: dict, path: str | os.PathLike) -> None:
    """adapter_model.safetensors and adapter_config.json into the directory `path` (one writer: rank 0)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    _write_atomic(path / ADAPTER_WEIGHTS, lambda f: save_file(tensors, f, metadata={"format": "pt"}))
    _write_atomic(path / ADAPTER_CONFIG, lambda f: f.write_text(json.dumps(config, indent=2) + "\n"))


def read_adapter_config(path: str | os.PathLike) -> dict:
    """adapter_config.json of the adapter directory `path`, checked: a LoRA adapter on a causal LM with
    target modules this model has, and no PEFT feature these adapters lack. Returns add_lora's arguments
    rank, alpha, targets, plus base_model_name_or_path."""
    from hf import read_json

    file = Path(path) / ADAPTER_CONFIG
    if not file.is_file():
        raise FileNotFoundError(f"{file}: missing; an adapter directory needs {ADAPTER_CONFIG} and {ADAPTER_WEIGHTS}.")
    c = read_json(file)
    if c.get("peft_type") != "LORA":
        raise ValueError(f"{file}: peft_type is {c.get('peft_type')!r}; only LORA adapters load here.")
    if c.get("task_type") not in (None, "CAUSAL_LM"):
        raise ValueError(f"{file}: task_type is {c.get('task_type')!r}; only CAUSAL_LM adapters load here.")
    on = [k for k in UNSUPPORTED if c.get(k) not in (None, False, {}, [])]
    if c.get("bias", "none") != "none":
        on.append("bias")
    if on:
        raise ValueError(f"{file}: uses PEFT feature(s) {on}, which lora.py does not implement.")
    r, alpha, modules = c.get("r"), c.get("lora_alpha"), c.get("target_modules")
    if not isinstance(r, int) or r < 1 or not isinstance(alpha, (int, float)) or alpha <= 0:
        raise ValueError(f"{file}: r must be an integer >= 1 and lora_alpha a number > 0, got {r!r} and {alpha!r}.")
    by_module = {m: t for t, m in TARGETS.items()}
    if not isinstance(modules, list) or not modules or any(m not in by_module for m in modules):
        raise ValueError(f"{file}: target_modules {modules!r} must be a list of names from {list(by_module)}.")
    targets = tuple(t for t in TARGETS if TARGETS[t] in modules)
    return dict(rank=r, alpha=alpha, targets=targets, base_model_name_or_path=c.get("base_model_name_or_path"))


@torch.no_grad()
def load_adapters(model: nn.Module, path: str | os.PathLike) -> nn.Module:
    """Load the adapter directory `path` (save_adapters' or PEFT's, in either layout) into a model wrapped by
    add_lora with the same rank, alpha and targets, strictly: a config that differs, or a missing, unexpected or
    mis-shaped tensor, is one ValueError sentence naming the file. Tensors are copied into the existing adapters (cast
    to their dtype); call it before wrapping the model for DDP/FSDP. Returns model."""
    spec = read_adapter_config(path)
    have = lora_spec(model)
    for key, field in (("rank", "r"), ("alpha", "lora_alpha"), ("targets", "target_modules")):
        if spec[key] != have[key]:
            raise ValueError(
                f"{Path(path) / ADAPTER_CONFIG}: {field} is {spec[key]!r}, the model's adapters have {have[key]!r}."
            )
    file = Path(path) / ADAPTER_WEIGHTS
    if not file.is_file():
        raise FileNotFoundError(f"{file}: missing; an adapter directory needs {ADAPTER_CONFIG} and {ADAPTER_WEIGHTS}.")
    expected = {
        f"{PEFT_PREFIX}{name}.{leaf}.weight": getattr(m, leaf)
        for name, m in lora_layers(model).items()
        for leaf in ("lora_A", "lora_B")
    }
    try:
        with safe_open(file, framework="pt") as f:
            keys = set(f.keys())
            if any(k.startswith(MULTIMODAL) for k in keys):  # for the multimodal layout (hf.decoder_prefix)
                expected = {MULTIMODAL + k.removeprefix(PEFT_PREFIX + "model."): p for k, p in expected.items()}
            extra, missing = sorted(keys - expected.keys()), sorted(expected.keys() - keys)
            if extra:
                raise ValueError(f"{file}: unexpected tensor {extra[0]!r} ({len(extra)} in all) for these adapters.")
            if missing:
                raise ValueError(f"{file}: lacks {len(missing)} adapter tensor(s), e.g. {missing[0]!r}.")
            tensors = {k: f.get_tensor(k) for k in expected}
    except SafetensorError as e:
        raise ValueError(f"{file}: unreadable safetensors file, truncated or corrupt ({e}).") from None
    for k, t in tensors.items():
        if t.shape != expected[k].shape:
            raise ValueError(f"{file}: tensor {k!r} has shape {tuple(t.shape)}, expected {tuple(expected[k].shape)}.")
    for k, t in tensors.items():
        expected[k].copy_(t)
    return model


def merge_checkpoint(
    adapter_dir: str | os.PathLike,
    out_dir: str | os.PathLike,
    base: str | os.PathLike | None = None,
    dtype: torch.dtype | None = None,
) -> None:
    """Write a full HF checkpoint to out_dir: the base model (base, default adapter_config.json's
    base_model_name_or_path) with the adapters of adapter_dir merged in, in `dtype` (None: the dtype the base
    checkpoint stores), tokenizer files copied from the base. Merged in float32 whatever the stored dtype."""
    from hf import save_model

    model, base = load_adapted(adapter_dir, base)
    save_model(model, out_dir, tokenizer_dir=base, state_dict=merged_state_dict(model), dtype=dtype)


def is_adapter_dir(path: str | os.PathLike) -> bool:
    """A directory of adapters (a LoRA run's checkpoint), not a full model."""
    return (Path(path) / ADAPTER_CONFIG).is_file()


def load_adapted(
    adapter_dir: str | os.PathLike, base: str | os.PathLike | None = None, device: str | torch.device = "cpu"
) -> tuple[Transformer, str]:
    """(the base model with adapter_dir's adapters, float32 on device; the base's directory): base defaults to
    adapter_config.json's base_model_name_or_path."""
    from hf import bundled, load_model

    spec = read_adapter_config(adapter_dir)
    base = base or spec.pop("base_model_name_or_path")
    if not base:
        raise ValueError(f"{Path(adapter_dir) / ADAPTER_CONFIG}: names no base model; pass --base MODEL_DIR.")
    base = bundled(str(base))
    spec.pop("base_model_name_or_path", None)
    model = load_adapters(add_lora(load_model(base, dtype=torch.float32, device=device), **spec), adapter_dir)
    return model, base


# ----------------------------------------------------------------------------- command line


@dataclass
class MergeConfig:
    merge: str = ""  # adapter directory to merge (adapter_config.json + adapter_model.safetensors)
    out: str = ""  # directory to write the merged HF checkpoint to
    base: str = ""  # base model directory (default: adapter_config.json's base_model_name_or_path)
    dtype: str = ""  # float32 | bfloat16 | float16 for the written weights (default: the base checkpoint's)
    overwrite: bool = False  # replace a non-empty --out (never one that holds a run, the adapters or the base)

    def __post_init__(self) -> None:
        if not self.merge or not self.out:
            raise ValueError("--merge ADAPTER_DIR and --out DIR are both required")
        if self.dtype not in ("", "float32", "bfloat16", "float16"):
            raise ValueError(f"--dtype must be float32, bfloat16 or float16, got {self.dtype!r}")


def main(cfg: MergeConfig) -> None:
    from checkpoint import check_replace  # --out is replaced whole: refuse one that holds what must stay

    base = cfg.base or read_adapter_config(cfg.merge)["base_model_name_or_path"] or ""
    check_replace(cfg.out, {"adapter directory (--merge)": cfg.merge, "base model": base}, cfg.overwrite)
    dtype = getattr(torch, cfg.dtype) if cfg.dtype else None
    merge_checkpoint(cfg.merge, cfg.out, cfg.base or None, dtype)
    print(f"wrote {cfg.out}: {cfg.merge} merged into {cfg.base or 'its base model'}")


if __name__ == "__main__":
    from cli import parse_config, user_errors

    with user_errors():
        main(parse_config(MergeConfig, sys.argv[1:], description=__doc__.split("\n\n")[0])[0])
