"""Joint NAS + mixed-precision quantization from Python (same objects as `llmcompress nas`), exported as GGUF.

    LLMCOMPRESS_DATA_DIR=../shared/data .venv/bin/python examples/nas_mixed_precision.py /tmp/nas-example
"""

import sys
from pathlib import Path

from llmcompress.io.load import load_model
from llmcompress.nas import NasConfig, run_nas

out = Path(sys.argv[1] if len(sys.argv) > 1 else "runs/nas-example")
# GGUF stores 4-, 5- and 8-bit blocks of 32 (llama.cpp has no 2/3-bit kernel for 576-wide rows)
cfg = NasConfig(model="smollm2-135m", target_latency=0.6, target_bits=4.0, bits=[4, 8, 16], train_tokens=2048,
                eval_tokens=2048, baselines=[], export=["gguf"])
run = run_nas(cfg, out, overwrite=True)
print(f"avg bits {run.arch['avg_bits']:.2f}, modeled latency {run.arch['modeled_latency']:.3f}, size {run.arch['size_mb']:.1f} MB")
print("GGUF:", run.arch["exports"]["gguf"])
lm = load_model(str(out / "gguf" / "model.gguf"))  # transformers dequantizes it
print(lm.model.config.num_hidden_layers, "layers in the exported model")
