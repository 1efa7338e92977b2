"""Hugging Face checkpoint directories: config.json <-> ModelConfig (the published layout and the
transformers-5 `rope_parameters` one), strict loading of one or many safetensors files, and atomic
saving of a directory that transformers loads back, tokenizer files copied alongside.
"""

import json
import os
import shutil
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

import torch
import torch.nn as nn
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import Tensor

from model import ARCHITECTURES, ModelConfig, Transformer

# ----------------------------------------------------------------------------- config.json


def read_json(file: Path) -> dict:
    """A JSON object from `file`; anything else is a one-line ValueError naming the file."""
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{file}: not valid JSON ({e}).") from None
    if not isinstance(data, dict):
        raise ValueError(f"{file}: expected a JSON object, got {type(data).__name__}.")
    return data


def config_from_hf(d: dict, path: str = "config.json") -> ModelConfig:
    """Parse an HF config.json: the published layout (top-level rope_theta / rope_scaling, whose
    type key is "rope_type" or the older "type") and the transformers-5 `rope_parameters` layout."""
    text = d.get("text_config") if isinstance(d.get("text_config"), dict) else {}
    quant = d.get("quantization_config") or text.get("quantization_config")
    if quant:  # FP8 / GPTQ / AWQ weights need their scales: loaded as plain weights they would be silently wrong
        method = quant.get("quant_method", "?") if isinstance(quant, dict) else quant
        raise ValueError(f"{path}: quantized checkpoints ({method}) are not supported; use the unquantized weights.")
    mt, dtype = d.get("model_type"), stated_dtype(d)
    if mt in ("qwen3_5", "qwen3_5_text"):  # Qwen3.5/3.6/3.8: a multimodal checkpoint holds its text model's config
        d, mt = qwen3_5_text_config(d, path), "qwen3_5"
    moe = [k for k in ("num_experts", "num_local_experts", "n_routed_experts", "moe_intermediate_size") if d.get(k)]
    if moe:
        raise ValueError(f"{path}: {moe[0]} is set, but mixture-of-experts (MoE) layers are not supported, only dense.")
    if mt not in ARCHITECTURES:
        raise ValueError(f"{path}: model_type {mt!r} is not supported (supported: {sorted(ARCHITECTURES)}).")
    if d.get("hidden_act", "silu") != "silu":
        raise ValueError(f"{path}: hidden_act {d['hidden_act']!r} is not supported (only 'silu').")
    sliding = d.get("use_sliding_window") or "sliding_attention" in (d.get("layer_types") or [])
    if sliding or (mt == "mistral" and d.get("sliding_window") is not None):
        raise ValueError(f"{path}: sliding-window attention is not supported; only full attention.")
    if d.get("mlp_bias"):
        raise ValueError(f"{path}: mlp_bias is not supported.")
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"):
        if key not in d:
            raise ValueError(f"{path}: required field {key!r} is missing.")
    rp = d.get("rope_parameters") or {}
    rs = dict(rp or d.get("rope_scaling") or {})
    rope_type = rs.pop("rope_type", None) or rs.pop("type", None) or "default"
    partial = rs.pop("partial_rotary_factor", d.get("partial_rotary_factor", 0.25 if mt == "qwen3_5" else 1.0))
    if partial != 1.0 and mt != "qwen3_5":
        raise ValueError(f"{path}: partial_rotary_factor is not supported for model_type {mt!r}.")
    if rope_type not in ("default", "llama3"):
        raise ValueError(f"{path}: rope type {rope_type!r} is not supported (only default and 'llama3').")
    llama3 = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
    scaling = {"rope_type": "llama3"} | {k: rs[k] for k in llama3 if k in rs} if rope_type == "llama3" else None
    heads = d["num_attention_heads"]
    try:
        return ModelConfig(
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            num_hidden_layers=d["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=d.get("num_key_value_heads") or heads,
            head_dim=d.get("head_dim") or d["hidden_size"] // heads,
            rms_norm_eps=d.get("rms_norm_eps", 1e-6),
            rope_theta=float(rp.get("rope_theta", d.get("rope_theta", 10000.0))),
            rope_scaling=scaling,
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            attention_bias=mt == "qwen2" or bool(d.get("attention_bias", False)),  # Qwen2: hard-coded in HF
            qk_norm=mt in ("qwen3", "qwen3_5"),
            model_type=mt,
            **(hybrid_fields(d, partial) if mt == "qwen3_5" else {}),
            max_position_embeddings=d.get("max_position_embeddings", 4096),
            bos_token_id=d.get("bos_token_id"),
            eos_token_id=d.get("eos_token_id"),
            **({"torch_dtype": dtype} if dtype else {}),  # absent: load_model reads the tensors' dtype
        )
    except ValueError as e:
        raise ValueError(f"{path}: {str(e).removeprefix('ModelConfig: ')}") from None


def stated_dtype(d: dict) -> str | None:
    """The dtype config.json states (transformers 5 writes "dtype", 4.x "torch_dtype"), in a multimodal config
    its text_config's or, when that is silent, its top level's; None when it states none."""
    text = d.get("text_config") if isinstance(d.get("text_config"), dict) else {}
    return next((c[k] for c in (text, d) for k in ("torch_dtype", "dtype") if c.get(k)), None)


def qwen3_5_text_config(d: dict, path: str) -> dict:
    """The text model's fields of a Qwen3.5/3.6 config.json: the causal-LM layout (model_type "qwen3_5_text") is flat;
    the published multimodal one (Qwen3_5ForConditionalGeneration, model_type "qwen3_5") nests them under
    text_config, its head tied by the top-level tie_word_embeddings, as transformers ties it."""
    if d.get("model_type") == "qwen3_5_text":
        return d
    text = d.get("text_config")
    if not isinstance(text, dict):
        raise ValueError(f"{path}: model_type 'qwen3_5' needs a text_config object (the text model's fields).")
    return text | {"tie_word_embeddings": d.get("tie_word_embeddings", text.get("tie_word_embeddings", False))}


def hybrid_fields(d: dict, partial: float) -> dict:
    """ModelConfig's Qwen3.5 fields from its config.json: each layer's mixer and the Gated DeltaNet's shape."""
    if d.get("attn_output_gate", True) is not True:
        raise ValueError("attn_output_gate false is not supported; Qwen3.5's attention always gates its output.")
    types = d.get("layer_types")
    if types is None:  # transformers' default: every full_attention_interval-th layer is full attention
        every = d.get("full_attention_interval", 4)
        types = [
            "full_attention" if (i + 1) % every == 0 else "linear_attention" for i in range(d["num_hidden_layers"])
        ]
    keys = ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim")
    defaults = dict(zip(keys, (16, 32, 128, 128))) | {"linear_conv_kernel_dim": 4}  # Qwen3_5TextConfig's
    return {k: d.get(k, v) for k, v in defaults.items()} | dict(layer_types=tuple(types), partial_rotary_factor=partial)


def config_to_hf(config: ModelConfig) -> dict:
    """config.json in the published layout (top-level rope_theta / rope_scaling) that
    transformers 4.x and 5.x both load."""
    d = {
        "architectures": [ARCHITECTURES[config.model_type]],
        "model_type": config.model_type,
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_hidden_layers,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "head_dim": config.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": config.rms_norm_eps,
        "rope_theta": config.rope_theta,
        "rope_scaling": config.rope_scaling,
        "tie_word_embeddings": config.tie_word_embeddings,
        "max_position_embeddings": config.max_position_embeddings,
        "bos_token_id": config.bos_token_id,
        "eos_token_id": config.eos_token_id,
        "torch_dtype": config.torch_dtype,
    }
    if config.model_type in ("llama", "qwen3", "qwen3_5"):
        d["attention_bias"] = config.attention_bias
    if config.model_type in ("qwen2", "qwen3"):
        d |= {"use_sliding_window": False, "sliding_window": None}
    if config.model_type == "mistral":
        d["sliding_window"] = None
    if config.model_type == "qwen3_5":  # the causal-LM layout, which transformers loads as Qwen3_5ForCausalLM
        keys = ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim")
        d |= {k: getattr(config, k) for k in (*keys, "linear_conv_kernel_dim")}
        d |= {"model_type": "qwen3_5_text", "layer_types": list(config.layer_types)}
        d |= {"partial_rotary_factor": config.partial_rotary_factor, "attn_output_gate": True}
    return d


# ----------------------------------------------------------------------------- weights


def _weight_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(read_json(index).get("weight_map", {}).values()))
        for f in files:
            if not (path / f).is_file():
                raise FileNotFoundError(f"{index}: names shard {f!r}, which is missing.")
        return [path / f for f in files]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{path}: no *.safetensors weight file found.")
    return files


BUNDLED = "assets/tiny-model"  # the default --model of train.py and eval.py (sft.py's --out), relative
BUNDLED_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), BUNDLED)  # the project's own copy


def bundled(path: str) -> str:
    """The default --model names the bundled checkpoint wherever the command runs from: when `path` is that
    relative name and the working directory has no such directory, the project's own copy is meant."""
    return BUNDLED_DIR if path == BUNDLED and not os.path.isdir(path) else path


def read_model_config(path: str | os.PathLike) -> dict:
    """config.json of the model directory `path`, read without the weights; a missing directory or file is one
    FileNotFoundError sentence, and one for a LoRA adapter directory (adapter_config.json, no config.json) says how
    to use it."""
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"{path}: model directory not found.")
    if not (path / "config.json").is_file() and (path / "adapter_config.json").is_file():
        try:
            adapter = read_json(path / "adapter_config.json")
        except (OSError, ValueError):
            adapter = {}
        base, rank = adapter.get("base_model_name_or_path") or "BASE_MODEL", adapter.get("r") or "R"
        run = path.parent if (path / "trainer_state.pt").is_file() else "RUN"  # a LoRA run's checkpoint: its run
        raise FileNotFoundError(
            f"{path} is a LoRA adapter directory (adapter_config.json, no config.json), not a full model: merge it "
            f"with `python lora.py --merge {path} --out MERGED` and pass --model MERGED, or continue its run with "
            f"--model {base} --lora-rank {rank} --resume {run}."
        )
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path / 'config.json'}: missing; a model directory needs config.json.")
    return read_json(path / "config.json")


def decoder_prefix(path: str | os.PathLike) -> str:
    """Where the class the model directory's config.json names holds the decoder: "model.language_model." in the
    published Qwen3.5 layout (Qwen3_5ForConditionalGeneration), else "model."; PEFT's adapter keys follow it (on
    that class it only warns about model.layers keys, then runs the bare base; AutoModelForCausalLM takes the former
    with a key_mapping: docs/real-models.md)."""
    file = Path(bundled(str(path))) / "config.json"
    return "model.language_model." if file.is_file() and read_json(file).get("model_type") == "qwen3_5" else "model."


def text_model_name(key: str, config: ModelConfig) -> str | None:
    """A checkpoint tensor's name in the model, or None for one it does not use: a Qwen3.5 multimodal checkpoint
    stores the text model under model.language_model., beside its vision tower (model.visual.) and its
    multi-token-prediction head (mtp.), which text generation never runs."""
    if config.model_type != "qwen3_5":
        return key
    if key.startswith(("model.visual.", "mtp.")):
        return None
    return "model." + key.removeprefix("model.language_model.") if key.startswith("model.language_model.") else key


def load_model(
    path: str | os.PathLike, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"
) -> Transformer:
    """Load an HF checkpoint directory strictly: every tensor must be present, expected and of the
    right shape. Built on the meta device and filled in the target dtype/device (4 threads casting),
    so no second full copy of the weights ever exists. model.config.torch_dtype keeps the dtype the
    checkpoint stores (config.json's torch_dtype / dtype, else its embedding tensor's), whatever
    `dtype` the weights are loaded in, so save_model writes it back in that dtype."""
    path = Path(path)
    raw = read_model_config(path)
    config = config_from_hf(raw, str(path / "config.json"))
    with torch.device("meta"):
        model = Transformer(config)
    expected = dict(model.named_parameters())  # tied: lm_head.weight is not listed separately
    tied_head = "lm_head.weight" if config.tie_word_embeddings else None  # a tied head some exports store too
    loaded: set[str] = set()
    head = None
    for file in _weight_files(path):
        try:
            tensors = {}  # name -> tensor on the file's memory map (nothing read yet)
            with safe_open(file, framework="pt") as f:
                for key in f.keys():
                    name = text_model_name(key, config)
                    if name is None:
                        continue
                    kind = f.get_slice(key).get_dtype()  # "BF16", "F32"; FP8's "F8_E4M3" or an integer is quantized
                    if kind.startswith(("F8", "I", "U")) or name.endswith(("_scale", "_scale_inv")):
                        raise ValueError(
                            f"{file}: tensor {key!r} ({kind}) is quantized, and quantized checkpoints are not "
                            "supported; use the unquantized weights."
                        )
                    if name not in expected and name != tied_head:
                        raise ValueError(f"{file}: unexpected tensor {name!r} for a {config.model_type} model.")
                    if name in loaded:
                        raise ValueError(f"{file}: tensor {name!r} appears in more than one file.")
                    t = f.get_tensor(key)
                    if name == "model.embed_tokens.weight":
                        stored, embed = str(t.dtype).removeprefix("torch."), t
                    shape = expected.get(name, expected["model.embed_tokens.weight"]).shape
                    if t.shape != shape:
                        raise ValueError(
                            f"{file}: tensor {name!r} has shape {tuple(t.shape)}, config.json implies {tuple(shape)}."
                        )
                    if name == tied_head:
                        head = t
                        continue
                    tensors[name] = t
                    loaded.add(name)
        except SafetensorError as e:
            raise ValueError(f"{file}: unreadable safetensors file, truncated or corrupt ({e}).") from None
        # read and cast in 4 threads (torch releases the GIL): the page faults of reading the map and
        # of filling the new tensors run in parallel, 2x faster at Qwen2.5-0.5B than one tensor at a time
        with ThreadPoolExecutor(4) as pool:
            cast = pool.map(lambda t: t.to(device=device, dtype=dtype), tensors.values())
            for name, t in zip(tensors, cast):
                module, _, leaf = name.rpartition(".")
                setattr(model.get_submodule(module), leaf, nn.Parameter(t))
    missing = sorted(expected.keys() - loaded)
    if missing:
        raise ValueError(f"{path}: checkpoint lacks {len(missing)} tensor(s), e.g. {missing[:3]}.")
    if head is not None and not torch.equal(head, embed):  # as transformers: a stored head that differs is kept
        config = replace(config, tie_word_embeddings=False)
        model.lm_head.weight = nn.Parameter(head.to(device=device, dtype=dtype))
    elif config.tie_word_embeddings:  # re-tie: assignment replaced embed_tokens' Parameter
        model.lm_head.weight = model.model.embed_tokens.weight
    model.config = config if stated_dtype(raw) else replace(config, torch_dtype=stored)  # silent: the file's dtype
    return model


TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "generation_config.json",
    "chat_template.jinja",
)


def copy_tokenizer(src: str | os.PathLike, dst: str | os.PathLike) -> None:
    """The tokenizer files of the model directory src (those it has) copied into dst."""
    for name in TOKENIZER_FILES:
        if (Path(src) / name).is_file():
            shutil.copy(Path(src) / name, Path(dst) / name)


def umask() -> int:
    """This process's umask: /proc/self/status's Umask line (Linux), else set and put back (os.umask has no getter)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def plain_permissions(path: str | os.PathLike) -> None:
    """Give `path`, and under a directory everything in it, the permissions a plain open() or mkdir() gives: 0666 or
    0777 less the umask. tempfile.mkdtemp makes 0700, tempfile.mkstemp and safetensors' save_file 0600, and
    shutil.copy keeps the source's: checkpoints that other users of a machine could not read."""
    mask, path = umask(), Path(path)
    for p in [path, *path.rglob("*")] if path.is_dir() else [path]:
        if not p.is_symlink():
            os.chmod(p, (0o777 if p.is_dir() else 0o666) & ~mask)


def save_model(
    model: Transformer,
    path: str | os.PathLike,
    tokenizer_dir: str | os.PathLike | None = None,
    *,
    state_dict: dict[str, Tensor] | None = None,
    dtype: torch.dtype | None = None,
) -> None:
    """Write an HF directory (config.json, model.safetensors, generation_config.json, tokenizer
    files copied from tokenizer_dir) that transformers loads. Atomic: written to a temporary
    directory next to `path`, then renamed over it. state_dict: full tensors when the model's
    own parameters are sharded (FSDP). dtype: of the written weights, recorded as config.json's
    torch_dtype; None = model.config.torch_dtype, the dtype the checkpoint was loaded from
    (float32 for a model built from scratch), so float32 training of a bf16 model saves bf16."""
    path = Path(path)
    stored = str(dtype).removeprefix("torch.") if dtype is not None else model.config.torch_dtype
    config = replace(model.config, torch_dtype=stored)  # validates the name
    sd = state_dict if state_dict is not None else model.state_dict()
    with torch.device("meta"):
        unexpected = sorted(sd.keys() - Transformer(config).state_dict().keys())
    if unexpected:  # e.g. LoRA adapters, which transformers would drop silently
        raise ValueError(
            f"save_model: {unexpected[0]!r} is no tensor of a {config.model_type} checkpoint; for LoRA adapters "
            f"pass state_dict=lora.merged_state_dict(model), or write them with lora.save_adapters."
        )
    tensors = {
        k: v.detach().to("cpu", getattr(torch, stored)).contiguous()
        for k, v in sd.items()
        if not (k == "lm_head.weight" and config.tie_word_embeddings)
    }  # HF omits a tied head
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.tmp-", dir=path.parent))
    try:
        (tmp / "config.json").write_text(json.dumps(config_to_hf(config), indent=2) + "\n")
        save_file(tensors, tmp / "model.safetensors", metadata={"format": "pt"})
        if tokenizer_dir is not None:
            copy_tokenizer(tokenizer_dir, tmp)
        if not (tmp / "generation_config.json").exists() and config.eos_token_id is not None:
            gen = {"bos_token_id": config.bos_token_id, "eos_token_id": config.eos_token_id}
            (tmp / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
        plain_permissions(tmp)  # mkdtemp's 0700, save_file's 0600: what the umask allows instead
        old = None
        if path.exists():  # move the old copy aside first: a crash leaves the old or the new one
            old = Path(tempfile.mkdtemp(prefix=f".{path.name}.old-", dir=path.parent))
            os.replace(path, old / path.name)
        os.replace(tmp, path)
        if old is not None:
            shutil.rmtree(old)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
