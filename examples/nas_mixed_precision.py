"""Joint NAS + mixed-precision quantization from Python (same objects as `llmcompress nas`).

    LLMCOMPRESS_DATA_DIR=../shared/data .venv/bin/python examples/nas_mixed_precision.py /tmp/nas-example
"""

import sys
from pathlib import Path

from llmcompress.nas import NasConfig, load_packed, run_nas

out = Path(sys.argv[1] if len(sys.argv) > 1 else "runs/nas-example")
cfg = NasConfig(model="smollm2-135m", target_latency=0.6, target_bits=4.0, train_tokens=2048, eval_tokens=2048, baselines=[])
run = run_nas(cfg, out, overwrite=True)
print(f"avg bits {run.arch['avg_bits']:.2f}, modeled latency {run.arch['modeled_latency']:.3f}, size {run.arch['size_mb']:.1f} MB")
model, tok = load_packed(out / "packed")
print(model.config.num_hidden_layers, "layers in the packed model")
