"""Data: named datasets, local files, data-free `self` text, and packing into token blocks."""

from llmcompress.data.blocks import calibration_blocks, pack_blocks, token_stream
from llmcompress.data.sources import DATASETS, detokenize_wikitext, load_texts

__all__ = ["DATASETS", "detokenize_wikitext", "load_texts", "calibration_blocks", "pack_blocks", "token_stream"]
