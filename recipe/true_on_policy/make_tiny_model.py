"""Build a tiny, deterministic Qwen3 / Qwen3-MoE checkpoint (weights + BPE tokenizer) for CPU tests.

There is no model hub here, so tests and smoke runs need a model made from nothing.
The output is a standard HF checkpoint directory that transformers and vLLM both load:
config.json, generation_config.json, model.safetensors (the classic on-disk parameter
names, per-expert for MoE, as in real Qwen3-30B-A3B checkpoints) and a byte-level BPE
tokenizer trained locally on a synthetic arithmetic-flavoured corpus.

The same arguments always give byte-identical files: weights come from one CPU
torch.Generator walked in sorted-name order, and BPE training is deterministic.

    python -m true_on_policy.make_tiny_model --arch qwen3_moe --out /tmp/tiny-moe
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import random
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file

from .models.config import ARCHITECTURES, DTYPES
from .tool_calls import CALL_TOKEN

# Bump when the output layout or generation changes: it is part of the cache key.
FORMAT_VERSION = 1

# arch -> (HF architecture class, tie embeddings by default), for the architectures the shared
# model covers. Qwen3 small dense models tie embeddings; Qwen3-MoE models do not.
ARCHS = {arch: (name, arch == "qwen3") for name, arch in ARCHITECTURES.items()}

DEFAULTS = dict(
    hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=64,
    intermediate_size=512, moe_intermediate_size=128, num_experts=8, top_k=2,
    vocab_size=None, tokenizer_vocab=1000, max_position=4096, rope_theta=1e6,
    init_std=0.02, tie_word_embeddings=None, dtype="bfloat16", seed=0, call_token_prob=0.0,
)

# Qwen's special tokens, appended after the BPE vocabulary like Qwen's own (151643..).
ENDOFTEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + "
    "message['content'] + '<|im_end|>' + '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
# Qwen2/3 pre-tokenizer split: \p{N} matches ONE digit, so every number is digit tokens.
QWEN_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
              r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
COMMON_WORDS = (
    "the of and to in is it that for on with as was at by this be are from or have an they "
    "which one you had not but what all were when we there can number more how many each she "
    "do their if will up other about out then them these so some her would make like him into "
    "time has look two write go see way could people than first water been call who its now "
    "find long down day did get come made may part sum total equal plus minus times answer "
    "question first second step think compute result apples books coins left gives buys sells"
).split()


# ----------------------------------------------------------------------------- tokenizer
def _pseudo_words(rng: random.Random, n: int) -> list[str]:
    """English-like made-up words, so BPE has enough sub-word structure to learn ~1k merges."""
    onsets = "b c d f g h j k l m n p r s t v w st tr pl br ch sh th gr cl".split()
    vowels = "a e i o u ea ou ai io".split()
    codas = ["", "", "n", "r", "s", "t", "l", "nd", "ng", "st", "ck", "ll", "rt"]
    return ["".join(rng.choice(onsets) + rng.choice(vowels) + rng.choice(codas)
                    for _ in range(rng.randint(1, 3))) for _ in range(n)]


def synthetic_corpus(n: int = 4000) -> list[str]:
    """Prose-like lines plus arithmetic Q/A lines, from a fixed seed (independent of --seed)."""
    rng = random.Random(20240601)
    words = COMMON_WORDS * 4 + _pseudo_words(rng, 600)  # common words weigh more
    lines = []
    for _ in range(n):
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        op, val = rng.choice([("+", a + b), ("-", a - b), ("*", a * b)])
        lines += [
            " ".join(rng.choice(words) for _ in range(rng.randint(4, 14))).capitalize() + ".",
            f"{a}{op}{b}={val}",
            f"Question: What is {a}{op}{b}? Answer: {val}",
            f"Let's think step by step. {a} {op} {b} = {val}. The answer is \\boxed{{{val}}}.\n#### {val}",
        ]
    return lines


def train_tokenizer(vocab_target: int):
    """Byte-level BPE with Qwen's pre-tokenizer; Qwen's special tokens go after the merges."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers
    from tokenizers import pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_target, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(synthetic_corpus(), trainer)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t in (ENDOFTEXT, IM_START, IM_END)])
    return tok


def _write_tokenizer(tok, out: Path) -> None:
    """tokenizer.json + a Qwen-style tokenizer_config.json (no BOS added, like Qwen)."""
    tok.save(str(out / "tokenizer.json"), pretty=True)
    _write_json(out / "tokenizer_config.json", {
        "tokenizer_class": "PreTrainedTokenizerFast", "chat_template": CHAT_TEMPLATE,
        "bos_token": None, "eos_token": IM_END, "pad_token": ENDOFTEXT,
        "add_bos_token": False, "clean_up_tokenization_spaces": False,
        "model_max_length": 131072, "split_special_tokens": False})


# ----------------------------------------------------------------------------- arguments
def _fail(msg: str):
    raise ValueError(f"make_tiny_model: {msg}")


def resolve_args(arch: str, **sizes) -> dict:
    """Fill defaults and validate; every error names the flag, the bad value and a fix."""
    if arch not in ARCHS:
        _fail(f"unknown --arch {arch!r}; choose one of {', '.join(ARCHS)}")
    unknown = set(sizes) - set(DEFAULTS)
    if unknown:
        raise TypeError(f"make_tiny_model: unknown argument(s) {sorted(unknown)}; "
                        f"valid ones are {sorted(DEFAULTS)}")
    s = {**DEFAULTS, **{k: v for k, v in sizes.items() if v is not None}}
    if s["tie_word_embeddings"] is None:
        s["tie_word_embeddings"] = ARCHS[arch][1]
    _validate(arch, s)
    return s


def _validate(arch: str, s: dict) -> None:
    for k in ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
              "intermediate_size", "moe_intermediate_size", "num_experts", "top_k", "max_position"):
        if not isinstance(s[k], int) or s[k] <= 0:
            _fail(f"--{k.replace('_', '-')} must be a positive integer, got {s[k]!r}")
    h, kv = s["num_heads"], s["num_kv_heads"]
    if h % kv:
        ok = [d for d in range(1, h + 1) if h % d == 0]
        _fail(f"--num-heads {h} is not a multiple of --num-kv-heads {kv} (GQA); "
              f"use a --num-kv-heads in {ok}")
    if s["head_dim"] % 2:
        _fail(f"--head-dim {s['head_dim']} is odd; rotary embeddings need an even head dim")
    if arch == "qwen3_moe" and s["top_k"] > s["num_experts"]:
        _fail(f"--top-k {s['top_k']} exceeds --num-experts {s['num_experts']}; "
              f"lower --top-k or raise --num-experts")
    if s["tokenizer_vocab"] <= 256:
        _fail(f"--tokenizer-vocab {s['tokenizer_vocab']} leaves no room for merges "
              f"over the 256-byte alphabet; use e.g. 1000")
    if s["dtype"] not in DTYPES:
        _fail(f"--dtype {s['dtype']!r} is not one of {', '.join(DTYPES)}")
    if not 0 <= s["call_token_prob"] < 1:
        _fail(f"--call-token-prob {s['call_token_prob']} must be in [0, 1) (0: off)")
    if s["call_token_prob"] and s["tie_word_embeddings"]:
        _fail("--call-token-prob needs an untied LM head; pass --no-tie-word-embeddings or use qwen3_moe")
    if s["init_std"] <= 0 or s["rope_theta"] <= 0:
        _fail(f"--init-std ({s['init_std']}) and --rope-theta ({s['rope_theta']}) must be > 0")


def padded_vocab_size(n_tokens: int, requested: int | None) -> int:
    """Default: round UP to a multiple of 128 and keep >= 1 padded row (Qwen: 151936 > 151669)."""
    if requested is None:
        return (n_tokens // 128 + 1) * 128
    if requested < n_tokens:
        _fail(f"--vocab-size {requested} is smaller than the tokenizer ({n_tokens} tokens); "
              f"use >= {n_tokens} or omit it for the default {padded_vocab_size(n_tokens, None)}")
    return requested


# ----------------------------------------------------------------------------- model
def hf_config(arch: str, s: dict, ids: dict) -> dict:
    """config.json with both the transformers-5 keys (dtype, rope_parameters) and the
    classic ones (torch_dtype, rope_theta) that vLLM / older readers look for."""
    cfg = {
        "architectures": [ARCHS[arch][0]], "model_type": arch,
        "hidden_size": s["hidden_size"], "num_hidden_layers": s["num_layers"],
        "num_attention_heads": s["num_heads"], "num_key_value_heads": s["num_kv_heads"],
        "head_dim": s["head_dim"], "intermediate_size": s["intermediate_size"],
        "vocab_size": s["vocab_size"], "max_position_embeddings": s["max_position"],
        "rope_theta": s["rope_theta"], "rope_scaling": None,
        "rope_parameters": {"rope_type": "default", "rope_theta": s["rope_theta"]},
        "hidden_act": "silu", "rms_norm_eps": 1e-6, "attention_bias": False,
        "attention_dropout": 0.0, "initializer_range": s["init_std"],
        "tie_word_embeddings": s["tie_word_embeddings"], "use_cache": True,
        "use_sliding_window": False, "sliding_window": None, "max_window_layers": s["num_layers"],
        "torch_dtype": s["dtype"], "dtype": s["dtype"], **ids,
    }
    if arch == "qwen3_moe":
        cfg.update(num_experts=s["num_experts"], num_experts_per_tok=s["top_k"],
                   moe_intermediate_size=s["moe_intermediate_size"], norm_topk_prob=True,
                   decoder_sparse_step=1, mlp_only_layers=[], output_router_logits=False,
                   router_aux_loss_coef=0.001)
    return cfg


def param_shapes(arch: str, s: dict) -> dict[str, tuple[int, ...]]:
    """Classic HF on-disk names -> shapes (per-expert MoE names, as vLLM and real checkpoints)."""
    H, D, V = s["hidden_size"], s["head_dim"], s["vocab_size"]
    shapes = {"model.embed_tokens.weight": (V, H), "model.norm.weight": (H,)}
    if not s["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (V, H)  # tied: only embed_tokens is saved, as HF does
    for layer in range(s["num_layers"]):
        p = f"model.layers.{layer}."
        shapes.update({
            p + "input_layernorm.weight": (H,), p + "post_attention_layernorm.weight": (H,),
            p + "self_attn.q_proj.weight": (s["num_heads"] * D, H),
            p + "self_attn.k_proj.weight": (s["num_kv_heads"] * D, H),
            p + "self_attn.v_proj.weight": (s["num_kv_heads"] * D, H),
            p + "self_attn.o_proj.weight": (H, s["num_heads"] * D),
            p + "self_attn.q_norm.weight": (D,), p + "self_attn.k_norm.weight": (D,)})
        if arch == "qwen3_moe":
            shapes[p + "mlp.gate.weight"] = (s["num_experts"], H)  # the router
            mlps = [f"{p}mlp.experts.{e}." for e in range(s["num_experts"])]
            inter = s["moe_intermediate_size"]
        else:
            mlps, inter = [p + "mlp."], s["intermediate_size"]
        for m in mlps:
            shapes.update({m + "gate_proj.weight": (inter, H), m + "up_proj.weight": (inter, H),
                           m + "down_proj.weight": (H, inter)})
    return shapes


def init_weights(shapes: dict, s: dict) -> dict[str, torch.Tensor]:
    """RMSNorm weights (incl. q_norm/k_norm) = 1; every matrix (router too) ~ N(0, init_std).
    One CPU generator walked in sorted-name order, drawn in fp32 then cast, so the
    bits depend only on (seed, shapes, dtype) and never on dict or module order."""
    gen = torch.Generator(device="cpu").manual_seed(s["seed"])
    dtype, out = DTYPES[s["dtype"]], {}
    for name in sorted(shapes):
        if "norm" in name.rsplit(".", 2)[-2]:
            w = torch.ones(shapes[name])
        else:
            w = torch.empty(shapes[name]).normal_(0.0, s["init_std"], generator=gen)
        out[name] = w.to(dtype).contiguous()
    return out


def with_call_token(weights: dict, s: dict, ids: list, n_tok: int) -> dict:
    """A model that writes the tool-call token (true_on_policy.tool_calls) with probability
    ~``call_token_prob`` at every position: every embedding row carries 1.0 in feature 0,
    no attention or MLP output writes to it (row 0 of o_proj / down_proj is zero), so
    feature 0 of the final norm's output is ~sqrt(H / (1 + (H-1) std^2)) for every token;
    the call token's LM-head row reads it with the weight that gives that token the
    probability p against n_tok - 1 near-uniform others."""
    (call,) = ids
    dtype, H, p = DTYPES[s["dtype"]], s["hidden_size"], s["call_token_prob"]
    out = {n: w.float().clone() for n, w in weights.items()}
    out["model.embed_tokens.weight"][:, 0] = 1.0
    for name, w in out.items():
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            w[0] = 0.0
    feature = math.sqrt(H / (1 + (H - 1) * s["init_std"] ** 2))
    out["lm_head.weight"][call, 0] = math.log(p / (1 - p) * (n_tok - 1)) / feature
    return {n: w.to(dtype).contiguous() for n, w in out.items()}


# ----------------------------------------------------------------------------- output
def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")


def _build_into(out: Path, arch: str, s: dict, weights: bool = True) -> dict:
    """Write every file of the checkpoint into `out` (an empty dir); return a summary. weights=False:
    all but model.safetensors (vLLM's load_format="dummy" draws random weights for the shape)."""
    tok = train_tokenizer(s["tokenizer_vocab"])
    n_tok = tok.get_vocab_size(with_added_tokens=True)
    s = {**s, "vocab_size": padded_vocab_size(n_tok, s["vocab_size"])}
    eot, eos = tok.token_to_id(ENDOFTEXT), tok.token_to_id(IM_END)
    ids = {"bos_token_id": eot, "eos_token_id": eos, "pad_token_id": eot}
    shapes = param_shapes(arch, s)
    if weights:
        tensors = init_weights(shapes, s)
        if s["call_token_prob"]:
            tensors = with_call_token(tensors, s, tok.encode(CALL_TOKEN).ids, n_tok)
        save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    _write_json(out / "config.json", hf_config(arch, s, ids))
    # Qwen's generation config stops on either <|im_end|> or <|endoftext|>; no sampling
    # defaults, so engines use exactly the sampling params a test asks for.
    _write_json(out / "generation_config.json", {**ids, "eos_token_id": [eos, eot]})
    _write_tokenizer(tok, out)
    return {"params": sum(math.prod(shape) for shape in shapes.values()), "tokens": n_tok,
            "vocab_size": s["vocab_size"]}


def make_tiny_model(out_dir, arch: str = "qwen3_moe", overwrite: bool = False, weights: bool = True,
                    **sizes) -> Path:
    """Build the checkpoint in a sibling temp dir, then rename it into place, so a
    crash never leaves a half-written model at `out_dir`. weights=False: config, generation config
    and tokenizer alone (for vLLM's load_format="dummy": a full-size shape costs no disk)."""
    s, out = resolve_args(arch, **sizes), Path(out_dir).resolve()
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise FileExistsError(f"make_tiny_model: {out} is not empty; remove it, pick another "
                              f"--out, or pass --overwrite")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        info = _build_into(tmp, arch, s, weights)
        for f in tmp.iterdir():  # mkdtemp/safetensors create owner-only files; let others read
            f.chmod(0o644)
        tmp.chmod(0o755)
        if overwrite and out.exists():
            shutil.rmtree(out)
        os.rename(tmp, out)  # atomic; fails if another process filled `out` meanwhile
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    print(f"[make_tiny_model] {arch}: {info['params'] / 1e6:.2f}M params{'' if weights else ' (no weights written)'}, "
          f"tokenizer {info['tokens']} tokens, vocab_size {info['vocab_size']}, {s['dtype']} -> {out}")
    return out


def cache_key(arch: str, **sizes) -> str:
    """Hash of the resolved arguments plus the format and library versions that shape the bytes."""
    import tokenizers
    args = resolve_args(arch, **sizes)
    if not args["call_token_prob"]:
        del args["call_token_prob"]      # keys of models made before the option stay as they were
    blob = json.dumps({"arch": arch, "args": args, "format": FORMAT_VERSION,
                       "torch": torch.__version__, "tokenizers": tokenizers.__version__},
                      sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def ensure_tiny_model(cache_dir, arch: str = "qwen3_moe", **sizes) -> Path:
    """Return a cached tiny model for these arguments, building it on first use."""
    out = Path(cache_dir) / f"tiny-{arch}-{cache_key(arch, **sizes)}"
    if (out / "model.safetensors").is_file():  # only complete models are ever renamed in
        return out.resolve()
    try:
        return make_tiny_model(out, arch, **sizes)
    except (FileExistsError, OSError):
        if (out / "model.safetensors").is_file():  # another process won the race
            return out.resolve()
        raise


# ----------------------------------------------------------------------------- CLI
def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m true_on_policy.make_tiny_model",
                                description=__doc__.split("\n")[0])
    p.add_argument("--arch", required=True, choices=list(ARCHS))
    p.add_argument("--out", required=True, help="output checkpoint directory")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty --out")
    p.add_argument("--no-weights", dest="weights", action="store_false",
                   help="write no model.safetensors: config and tokenizer alone, for vLLM's load_format=dummy")
    for k, v in DEFAULTS.items():
        flag = "--" + k.replace("_", "-")
        if k == "tie_word_embeddings":
            p.add_argument(flag, action=argparse.BooleanOptionalAction, default=None,
                           help="default: tie for qwen3, untie for qwen3_moe")
        elif k == "vocab_size":
            p.add_argument(flag, type=int, default=None,
                           help="default: tokenizer size rounded up to a multiple of 128 (+ padding)")
        else:
            p.add_argument(flag, type=type(v), default=v,
                           choices=list(DTYPES) if k == "dtype" else None)
    return p


def main(argv=None) -> None:
    a = vars(_parser().parse_args(argv))
    arch, out, overwrite, weights = a.pop("arch"), a.pop("out"), a.pop("overwrite"), a.pop("weights")
    try:
        make_tiny_model(out, arch, overwrite=overwrite, weights=weights, **a)
    except (ValueError, FileExistsError) as e:
        raise SystemExit(f"error: {e}")


if __name__ == "__main__":
    main()
