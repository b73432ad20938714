"""Deployable exports: GGUF (llama.cpp and friends) and compressed-tensors (vLLM, transformers).

`export_model(src, to, out, ...)` (llmcompress.export.api) quantizes a model (RTN or GPTQ, or a `nas`
plan) and writes it; `write_gguf` / `write_compressed_tensors` write an already-quantized model.
"""

from __future__ import annotations


def __getattr__(name):
    if name in ("export_model", "quantize_for_export"):
        from llmcompress.export import api

        return getattr(api, name)
    if name == "write_gguf":
        from llmcompress.export.gguf import write_gguf

        return write_gguf
    if name == "write_compressed_tensors":
        from llmcompress.export.compressed_tensors import write_compressed_tensors

        return write_compressed_tensors
    raise AttributeError(name)


__all__ = ["export_model", "quantize_for_export", "write_gguf", "write_compressed_tensors"]
