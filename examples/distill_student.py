"""Distil a 15-layer student from smollm2-135m with the Python API (layer-wise curriculum).

    .venv/bin/python examples/distill_student.py --out /tmp/distilled --train-tokens 4096

Then load it with plain transformers: AutoModelForCausalLM.from_pretrained("/tmp/distilled/student").
"""

from __future__ import annotations

import argparse
from pathlib import Path

from llmcompress.distill import DistillConfig, distill


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=Path("/tmp/distilled"))
    ap.add_argument("--teacher", default="smollm2-135m")
    ap.add_argument("--keep-layers", type=int, default=15)
    ap.add_argument("--train-tokens", type=int, default=4096)
    a = ap.parse_args()
    cfg = DistillConfig(
        teacher=a.teacher,
        keep_layers=a.keep_layers,
        select="bi",  # drop the layers whose output is most like their input
        train_tokens=a.train_tokens,
        batch_size=2,
        seq_len=256,
        eval_tokens=2048,
    )
    result = distill(cfg, a.out, overwrite=True)
    m = result.metrics
    print(f"student {result.student_dir}: {m['student_layers']} layers, perplexity {m['student_before/ppl/wikitext2']:.1f} -> {m['ppl/wikitext2']:.1f} "
          f"(teacher {m['teacher/ppl/wikitext2']:.1f}); {m['train_wall_s']:.0f}s, peak {m['peak_rss_mb']:.0f} MiB")


if __name__ == "__main__":
    main()
