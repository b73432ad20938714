"""Write a LLaMA-family model as a GGUF file (llama.cpp, Ollama, LM Studio, llama-cpp-python, transformers).

Entry point: `write_gguf(model, out, qweights=..., float_dtype=..., tokenizer=...)`. `model` is a torch
`LlamaForCausalLM` (any number of layers: layers dropped or merged by collapse/distill are just fewer
blocks), `qweights` maps module FQNs to our integer weights (`llmcompress.quant.apply.QuantizedWeight`,
from RTN or GPTQ). The integers are packed into ggml blocks as they are, so GPTQ's rounding is kept:

    ours (primitives)                           ggml block (32 weights, 1 block = 1 row segment)
    asymmetric 4-bit: s * (q - z), q in 0..15    Q4_1: d * q + m      d = s, m = fp16(-z * s)
    asymmetric 5-bit: s * (q - z), q in 0..31    Q5_1: d * q + m      d = s, m = fp16(-z * s)
    symmetric 4-bit:  s * (q - 8)                Q4_0: d * (q - 8)    d = s            (exact)
    symmetric 5-bit:  s * (q - 16)               Q5_0: d * (q - 16)   d = s            (exact)
    symmetric 8-bit:  s * (q - 128)              Q8_0: d * int8       d = s, int8 = q - 128 (exact)

A group of 64 or 128 is 2 or 4 consecutive blocks with equal parameters. Our scales are float16 values
already, so d is exact; the only rounding is the asymmetric minimum m = -z * s stored as float16
(z has up to 5 bits, s 11 significant bits): |m_fp16 - m| <= 2**-11 |m| (half an ulp; 2**-25 absolute
in the float16 subnormal range), so each dequantized weight differs from ours by at most that, plus
float32 rounding of d*q + m (2**-24 of the result) -- zero whenever -z*s is a float16 value.
8-bit asymmetric has no ggml block (Q8_1 is an activation format): 8-bit weights must be symmetric.

Bit widths and llama.cpp kernels for SmolLM2's 576-wide rows: the legacy blocks of 32 (Q4_0, Q4_1,
Q5_0, Q5_1, Q8_0) run on every backend for any row length divisible by 32. The K-quants (Q2_K..Q6_K)
use super-blocks of 256, so a 576 (= 2.25 x 256) row cannot be stored in them (only ffn_down, 1536 wide,
could); 2- and 3-bit choices therefore have no kernel for this model, and `write_gguf` refuses them.
Most IQ types also need 256-blocks; IQ4_NL has blocks of 32 but a non-uniform codebook that our integer
grids do not map onto. Unquantized 2-D tensors are written as BF16/F16/F32 (the source
dtype), 1-D tensors (norms) as F32, as llama.cpp's convert_hf_to_gguf.py does.

Names, q/k row permutation and metadata follow convert_hf_to_gguf.py's LlamaModel (gguf-py's
TensorNameMap for names). Tokenizer: when the model's vocabulary is the one of the GGUF that
`smollm2-135m` ships in, its tokenizer keys are copied verbatim (pre-tokenizer `smollm`); otherwise a
byte-level BPE tokenizer is converted from tokenizer.json with gguf-py's BpeVocab/SpecialVocab
(pre-tokenizer `default`), as convert_hf_to_gguf.py's _set_vocab_gpt2 does.

Written by hand (with gguf's GGUFWriter): the block packing, because gguf.quants only quantizes from
floats (choosing its own scales) and so cannot carry GPTQ's integers.
"""

from __future__ import annotations

import functools
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from llmcompress.errors import UserError
from llmcompress.io.atomic import atomic_path

if TYPE_CHECKING:
    import numpy as np
    import torch

    from llmcompress.quant.apply import QuantizedWeight

BLOCK = 32
# (bits, symmetric) -> ggml type name; bit widths without an entry have no 32-block ggml type
GGML_TYPES = {(4, True): "Q4_0", (4, False): "Q4_1", (5, True): "Q5_0", (5, False): "Q5_1", (8, True): "Q8_0"}
GGUF_BITS = (4, 5, 8)
FLOAT_TYPES = {"float32": "F32", "float16": "F16", "bfloat16": "BF16"}
SUPPORTED_MODEL_TYPES = ("llama",)


def ggml_type_name(bits: int, sym: bool) -> str:
    """The ggml block type holding our `bits`-bit integers exactly; UserError when there is none."""
    name = GGML_TYPES.get((bits, bool(sym)))
    if name is None:
        if bits == 8:
            raise UserError("GGUF has no asymmetric 8-bit weight block (Q8_0 is symmetric)", "pass --sym for 8 bits")
        raise UserError(f"GGUF has no {bits}-bit block of 32 that llama.cpp runs on 576-wide rows (K-quants need rows "
                        "divisible by 256)", "use 4, 5 or 8 bits (or 16 for no quantization)")
    return name


def check_gguf_quantizable(qw: QuantizedWeight, name: str = "") -> None:
    out, inp = qw.q.shape
    ggml_type_name(qw.bits, qw.sym)
    if qw.group_size % BLOCK or inp % BLOCK:
        raise UserError(f"{name or 'a weight'}: group size {qw.group_size} / row length {inp} is not a multiple of "
                        f"ggml's block of {BLOCK}", "use --group-size 32, 64 or 128")


def pack_ggml_blocks(qw: QuantizedWeight) -> tuple[np.ndarray, str]:
    """Our integer weight (out, in) -> (uint8 array (out, in/32 * block bytes), ggml type name)."""
    import numpy as np
    import torch

    check_gguf_quantizable(qw)
    tname = ggml_type_name(qw.bits, qw.sym)
    out, inp = qw.q.shape
    nb = inp // BLOCK
    rep = qw.group_size // BLOCK
    q = qw.q.to(torch.int64).reshape(out, nb, BLOCK).numpy()
    scale = qw.scale.float().repeat_interleave(rep, dim=1)  # (out, nb), float16 values
    zero = qw.zero.to(torch.int64).repeat_interleave(rep, dim=1)
    d = scale.to(torch.float16).numpy().view(np.uint8).reshape(out, nb, 2)
    parts = [d]
    if tname in ("Q4_1", "Q5_1"):
        m = (-zero.double() * scale.double()).to(torch.float16).numpy().view(np.uint8).reshape(out, nb, 2)
        parts.append(m)
    if tname == "Q8_0":
        parts.append((q - 128).astype(np.int8).view(np.uint8))
    else:
        if tname in ("Q5_0", "Q5_1"):
            hi = ((q >> 4) & 1).astype(np.uint8)  # bit j of the little-endian uint32 qh = high bit of weight j
            parts.append(np.packbits(hi, axis=-1, bitorder="little"))
        lo = (q & 0xF).astype(np.uint8)
        parts.append(lo[..., : BLOCK // 2] | (lo[..., BLOCK // 2 :] << 4))  # byte j: weight j | weight j+16 << 4
    return np.concatenate(parts, axis=-1).reshape(out, -1), tname


def _permute_rows(x: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute (HF rotate-half rows -> ggml's interleaved rope rows);
    applied to packed rows, since every row is packed on its own."""
    return x.reshape(n_head, 2, x.shape[0] // n_head // 2, *x.shape[1:]).swapaxes(1, 2).reshape(x.shape)


def _rope_theta(cfg) -> float:
    rp = getattr(cfg, "rope_parameters", None) or {}
    return float(rp.get("rope_theta", getattr(cfg, "rope_theta", 10000.0)))


# --------------------------------------------------------------------------------------------- tokenizer
def _shipped_gguf() -> Path | None:
    try:
        from llmcompress.io.load import ALIASES, alias_gguf_path

        return alias_gguf_path(ALIASES["smollm2-135m"])
    except Exception:  # noqa: BLE001 - the package is optional; fall back to converting tokenizer.json
        return None


@functools.lru_cache(maxsize=2)
def _reader_kv(path: Path, prefix: str = "tokenizer.") -> list[tuple[str, Any, Any, Any]]:
    """(key, value, value type, array item type) of the fields of a GGUF whose key starts with `prefix`
    (cached: parsing 49k tokens and merges takes seconds)."""
    import gguf

    r = gguf.GGUFReader(str(path))
    out = []
    for key, f in r.fields.items():
        if not key.startswith(prefix):
            continue
        vtype = f.types[0]
        sub = f.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        out.append((key, f.contents(), vtype, sub))
    return out


def _tokens_of(tokenizer) -> list[str]:
    return tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))


def tokenizer_kv(tokenizer, vocab_size: int) -> tuple[list[tuple[str, Any, Any, Any]], str]:
    """GGUF tokenizer fields for `tokenizer` and where they came from."""
    import gguf

    shipped = _shipped_gguf()
    if shipped is not None:
        kv = _reader_kv(shipped)
        tokens = next(v for k, v, _, _ in kv if k == "tokenizer.ggml.tokens")
        if tokenizer is None or (len(tokenizer) == len(tokens) and _tokens_of(tokenizer) == tokens):
            if len(tokens) != vocab_size:
                raise UserError(f"the model's vocabulary has {vocab_size} rows, its tokenizer {len(tokens)} tokens",
                                "export a model whose embedding matches its tokenizer")
            return kv, f"copied from {shipped.name}"
    if tokenizer is None:
        raise UserError("the model has no tokenizer, which a GGUF needs", "export from a directory holding tokenizer.json")
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer.save_pretrained(tmp)
        try:
            vocab = gguf.vocab.BpeVocab(Path(tmp))
        except Exception as exc:  # noqa: BLE001 - not a byte-level BPE tokenizer
            raise UserError(f"cannot convert this tokenizer to GGUF ({type(exc).__name__}: {exc})",
                            "only byte-level BPE tokenizers (tokenizer.json) are supported") from None
        special = gguf.SpecialVocab(Path(tmp), load_merges=True, n_vocab=vocab_size)
        toks, types = [], []
        for text, _score, ttype in vocab.all_tokens():
            toks.append(text.decode("utf-8", errors="replace") if isinstance(text, bytes) else text)
            types.append(int(ttype))
        for tid in getattr(tokenizer, "all_special_ids", []):  # special tokens are CONTROL, as convert_hf_to_gguf.py
            if 0 <= tid < len(types):
                types[tid] = int(gguf.TokenType.CONTROL)
        if len(toks) < vocab_size:  # padded embedding rows, as convert_hf_to_gguf.py does
            toks += [f"[PAD{i}]" for i in range(len(toks), vocab_size)]
            types += [int(gguf.TokenType.UNUSED)] * (vocab_size - len(types))
    S, A = gguf.GGUFValueType.STRING, gguf.GGUFValueType.ARRAY
    kv: list = [("tokenizer.ggml.model", "gpt2", S, None), ("tokenizer.ggml.pre", "default", S, None),
                ("tokenizer.ggml.tokens", toks, A, S), ("tokenizer.ggml.token_type", types, A, gguf.GGUFValueType.INT32)]
    if special.merges:
        kv.append(("tokenizer.ggml.merges", list(special.merges), A, S))
    for typ, tid in special.special_token_ids.items():
        kv.append((f"tokenizer.ggml.{typ if typ != 'unk' else 'unknown'}_token_id", int(tid), gguf.GGUFValueType.UINT32, None))
    for typ, val in special.add_special_token.items():
        kv.append((f"tokenizer.ggml.add_{typ}_token", bool(val), gguf.GGUFValueType.BOOL, None))
    if special.chat_template:
        kv.append(("tokenizer.chat_template", special.chat_template, S, None))
    return kv, "converted from tokenizer.json (byte-level BPE, pre-tokenizer 'default')"


# --------------------------------------------------------------------------------------------- writer
def _float_array(t: torch.Tensor, dtype: str):
    """(array, raw ggml type or None) of a float tensor in `dtype` (BF16 via gguf.quants, bit-exact RNE)."""
    import gguf
    import numpy as np
    import torch

    if dtype == "bfloat16":
        a = t.detach().to(torch.bfloat16).view(torch.int16).numpy().view(np.uint8)
        return a.reshape(*t.shape[:-1], t.shape[-1] * 2), gguf.GGMLQuantizationType.BF16
    if dtype == "float16":
        return t.detach().to(torch.float16).numpy(), None
    return t.detach().to(torch.float32).numpy(), None


def _unique_named_tensors(model) -> list[tuple[str, torch.Tensor]]:
    seen, out = set(), []
    for name, t in model.state_dict().items():
        key = (t.data_ptr(), tuple(t.shape))
        if key in seen or not t.is_floating_point():
            continue
        seen.add(key)
        out.append((name, t))
    return out


def write_gguf(
    model,
    out: Path,
    *,
    qweights: dict[str, QuantizedWeight] | None = None,
    float_dtype: str = "bfloat16",
    tokenizer=None,
    name: str | None = None,
    metadata: dict[str, str] | None = None,
    overwrite: bool = False,
    separate_output: bool = False,
) -> dict:
    """Write `model` (LLaMA architecture) to the GGUF file `out`, atomically. Returns a summary dict
    (path, bytes, tensor types, tokenizer origin).

    qweights: module FQN -> integer weight (RTN/GPTQ); those linears are packed into ggml blocks (see the
        module docstring), an embedding tied to a quantized `lm_head` takes the lm_head's blocks.
    float_dtype: bfloat16 | float16 | float32, for the 2-D tensors that are not quantized.
    metadata: extra string fields, written under `llmcompress.` (llama.cpp ignores them).
    separate_output: for a model whose output matrix is tied to the token embedding, also write it as its
        own `output.weight` (same values and type). llama.cpp keeps `token_embd` in a plain CPU buffer
        (row lookups read it) and so runs a tied output matmul on the plain layout; a separate `output.weight`
        is repacked for its fast matmul kernels (Q4_0 -> q4_0_8x8 on AVX-512/AVX2). Costs a second copy.
    """
    import gguf
    import numpy as np

    from llmcompress.errors import OutputExists

    out = Path(out)
    if out.exists() and not overwrite:
        raise OutputExists(f"{out} already exists", "choose another --out, or pass --overwrite")
    cfg = model.config
    if cfg.model_type not in SUPPORTED_MODEL_TYPES:
        raise UserError(f"GGUF export supports {', '.join(SUPPORTED_MODEL_TYPES)} models, not {cfg.model_type!r}",
                        "export this model with --to compressed-tensors")
    if float_dtype not in FLOAT_TYPES:
        raise UserError(f"unknown float dtype {float_dtype!r}", f"use one of {', '.join(FLOAT_TYPES)}")
    qweights = dict(qweights or {})
    widths = {layer.mlp.down_proj.in_features for layer in model.model.layers}
    if len(widths) > 1:
        raise ValueError(f"per-layer MLP widths {sorted(widths)}: zero-pad the model first (llmcompress.export.pad)")
    n_layers = len(model.model.layers)
    n_head, n_kv = cfg.num_attention_heads, cfg.num_key_value_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // n_head
    tied = bool(getattr(cfg, "tie_word_embeddings", False))
    vocab_size = model.get_input_embeddings().weight.shape[0]
    tok_kv, tok_origin = tokenizer_kv(tokenizer, vocab_size)

    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, n_layers)
    types: dict[str, str] = {}
    with atomic_path(out) as tmp:
        w = gguf.GGUFWriter(str(tmp), "llama")
        w.add_type(gguf.GGUFType.MODEL)
        w.add_name(name or getattr(cfg, "name_or_path", "") or "llmcompress model")
        w.add_block_count(n_layers)
        w.add_context_length(int(cfg.max_position_embeddings))
        w.add_embedding_length(int(cfg.hidden_size))
        w.add_feed_forward_length(int(widths.pop()))
        w.add_head_count(int(n_head))
        w.add_head_count_kv(int(n_kv))
        w.add_rope_freq_base(_rope_theta(cfg))
        w.add_layer_norm_rms_eps(float(cfg.rms_norm_eps))
        w.add_rope_dimension_count(int(head_dim))
        if head_dim != cfg.hidden_size // n_head:
            w.add_key_length(int(head_dim))
            w.add_value_length(int(head_dim))
        w.add_vocab_size(int(vocab_size))
        for key, val, vtype, sub in tok_kv:
            w.add_key_value(key, val, vtype, sub_type=sub)
        for k, v in (metadata or {}).items():
            w.add_string(f"llmcompress.{k}", str(v))

        embed_fqn = "model.embed_tokens"
        for pname, t in _unique_named_tensors(model):
            fqn = pname.rsplit(".", 1)[0]
            if tied and fqn == "lm_head":
                continue
            gname = names.get_name(pname, try_suffixes=(".weight", ".bias"))
            if gname is None:
                raise ValueError(f"no GGUF name for tensor {pname}")
            qw = qweights.get(fqn)
            if qw is None and tied and fqn == embed_fqn:
                qw = qweights.get("lm_head")
            if qw is not None:
                check_gguf_quantizable(qw, pname)
                arr, tname = pack_ggml_blocks(qw)
                raw = gguf.GGMLQuantizationType[tname]
            elif t.dim() == 1:
                arr, raw, tname = t.detach().float().numpy(), None, "F32"
            else:
                arr, raw = _float_array(t, float_dtype)
                tname = FLOAT_TYPES[float_dtype]
            if pname.endswith("q_proj.weight"):
                arr = _permute_rows(arr, n_head)
            elif pname.endswith("k_proj.weight"):
                arr = _permute_rows(arr, n_kv)
            w.add_tensor(gname, np.ascontiguousarray(arr), raw_dtype=raw)
            types[gname] = tname
            if separate_output and tied and fqn == embed_fqn:
                oname = names.get_name("lm_head.weight", try_suffixes=(".weight",))
                w.add_tensor(oname, np.ascontiguousarray(arr), raw_dtype=raw)
                types[oname] = tname
        counts: dict[str, int] = {}
        for t in types.values():
            counts[t] = counts.get(t, 0) + 1
        w.add_file_type(_file_type(types))
        w.add_quantization_version(gguf.GGML_QUANT_VERSION)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
    return {"path": str(out), "bytes": out.stat().st_size, "tensor_types": counts, "tokenizer": tok_origin,
            "layers": n_layers, "float_dtype": float_dtype, "separate_output": bool(separate_output and tied)}


def _file_type(types: dict[str, str]) -> int:
    """general.file_type: the type of the most weights among 2-D tensors other than the embedding."""
    import gguf

    lin = [t for n, t in types.items() if n.startswith("blk.") and not n.endswith("norm.weight")]
    main = max(set(lin), key=lin.count) if lin else "F32"
    ft = {"F32": "ALL_F32", "F16": "MOSTLY_F16", "BF16": "MOSTLY_BF16", "Q4_0": "MOSTLY_Q4_0", "Q4_1": "MOSTLY_Q4_1",
          "Q5_0": "MOSTLY_Q5_0", "Q5_1": "MOSTLY_Q5_1", "Q8_0": "MOSTLY_Q8_0"}[main]
    return int(gguf.LlamaFileType[ft])


__all__ = ["GGML_TYPES", "GGUF_BITS", "ggml_type_name", "pack_ggml_blocks", "tokenizer_kv", "write_gguf"]
