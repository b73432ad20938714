"""Collapse smollm2-135m layers with a small GeLaCo Pareto search, through the Python API.

    LLMCOMPRESS_DATA_DIR=/work/shared/data python examples/collapse_pareto.py /tmp/collapse-example

Takes a few minutes on 2 CPU cores: tiny calibration set, 4 x 2 search, no perplexity/PIQA in the report.
"""

from __future__ import annotations

import sys
from pathlib import Path

from llmcompress.collapse import CollapseConfig, run_collapse


def main(out: Path) -> None:
    cfg = CollapseConfig(
        model="smollm2-135m",
        method="gelaco",
        pareto=True,
        min_layers=24,
        population=4,
        generations=2,
        calib_tokens=1024,
        val_tokens=512,
        eval_tokens=0,
        piqa_limit=0,
        save="knee",
    )
    result = run_collapse(cfg, out, overwrite=True)
    for r in result.front:
        print(f"{r['layers']:>3} layers  KL calib {r['kl_calib']:.3f}  val {r['kl_val']:.3f}  {r['changes']}")
    print("checkpoints:", *map(str, result.saved))


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "runs/collapse-example"))
