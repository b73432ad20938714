"""Every numeric option of every command is range-checked before any model loads (issue 25, findings 5 and 11).

Table-driven: each case runs the CLI in this process (run_app, as `llmcompress` does) on a model path that
does not exist, so a case that got past the range check would fail with "not found" instead; each must
exit 2 with one line naming the flag, the value and the valid range, and write nothing to --out.
"""

from __future__ import annotations

import math
import re

import pytest

BASE = {
    "eval": ["/no/such/model", "--no-speed"],
    "collapse": ["/no/such/model", "--pareto"],
    "distill": ["/no/such/model", "--keep-layers", "2"],
    "nas": ["/no/such/model", "--target-bits", "4"],
    "zip": ["/no/such/model"],
    "unzip": ["/no/such/model"],
    "export": ["/no/such/model", "--to", "gguf"],
}

HUGE, HUGE_F, SEED_OVER = str(10**13), "1e30", str(2**40)

# command -> flag -> bad values (0 only where 0 is invalid; every flag gets a negative and an absurd value)
BAD = {
    "eval": {
        "--seq-len": ["0", "1", "-1", HUGE],
        "--max-tokens": ["-5", HUGE],  # 0 means "all tokens" (documented)
        "--batch-size": ["0", "-1", HUGE],
        "--limit": ["0", "-3", HUGE_F, "nan"],
        "--num-fewshot": ["-1", HUGE],
        "--threads": ["-1", HUGE],
    },
    "collapse": {
        "--target-layers": ["0", "1", "-1", HUGE],
        "--ratio": ["0", "-0.5", "1", HUGE_F, "nan"],
        "--population": ["0", "-1", HUGE],
        "--generations": ["0", "-1", HUGE],
        "--seed": ["-1", SEED_OVER],
        "--refine-steps": ["-1", HUGE],
        "--tune-steps": ["-1", HUGE],
        "--calib-tokens": ["0", "-1", HUGE],
        "--val-tokens": ["0", "-1", HUGE],
        "--eval-tokens": ["-1", HUGE],
        "--piqa-limit": ["-1", HUGE],
        "--max-cache-gb": ["-1", HUGE_F, "nan"],
        "--budget-minutes": ["0", "-1", HUGE_F, "nan"],
        "--save": ["banana", "0", "-3", "1,2", HUGE],
    },
    "distill": {
        "--keep-layers": ["0", "-1", HUGE],
        "--train-tokens": ["0", "-1", HUGE],
        "--epochs": ["0", "-1", HUGE],
        "--segments": ["0", "-1", HUGE],
        "--e2e-steps": ["-1", HUGE],
        "--e2e-lr": ["0", "-1", HUGE_F],
        "--seq-len": ["1", "-1", HUGE],
        "--batch-size": ["0", "-1", HUGE],
        "--lr": ["0", "-1", HUGE_F, "nan"],
        "--kl-weight": ["-1", HUGE_F],
        "--ce-weight": ["-1", HUGE_F],
        "--phase1-fraction": ["-0.1", "1.5"],
        "--eval-tokens": ["-1", HUGE],
        "--threads": ["0", "-1", HUGE],
        "--seed": ["-1", SEED_OVER],
        "--grad-rank": ["0", "-1", HUGE],
        "--grad-rank-min": ["0", "-1", HUGE],
        "--grad-rank-max": ["0", "-1", HUGE],
        "--grad-warmup": ["1", "-1", HUGE],
        "--grad-entropy-span": ["0", "-0.1", "1.5", "nan"],
        "--act-rank": ["0", "-1", "banana", "2.5", HUGE],
        "--act-budget": ["0", "-0.1", "1.5", "nan"],
    },
    "nas": {
        "--target-latency": ["0", "-1", HUGE_F],
        "--target-size-mb": ["0", "-1", HUGE_F],
        "--target-bits": ["0", "-1", HUGE_F],
        "--bits": ["0,4", "-1", "4,99"],
        "--group-size": ["-1", HUGE],
        "--train-tokens": ["0", "-1", HUGE],
        "--eval-tokens": ["-1", HUGE],
        "--seed": ["-1", SEED_OVER],
        "--act-rank": ["0", "-1", "banana", HUGE],
        "--act-budget": ["0", "-1", "1.5", "nan"],
    },
    "zip": {"--threads": ["-1", HUGE], "--chunk-kb": ["0", "-1", HUGE]},
    "unzip": {"--threads": ["-1", HUGE]},
    "export": {"--bits": ["0", "-1", HUGE], "--embed-bits": ["0", "-1", HUGE], "--group-size": ["-1", HUGE], "--seed": ["-1", SEED_OVER]},
}

STRING_NUMBERS = ("--save", "--bits", "--act-rank")  # numbers in a string option (--act-rank also takes auto)
CASES = [(cmd, flag, v) for cmd, flags in BAD.items() for flag, values in flags.items() for v in values]
EXCLUSIVE = {"--target-layers", "--ratio"}  # collapse: these replace --pareto


def run_cli(capsys, *args):
    from llmcompress.cli import app
    from llmcompress.cli._errors import run_app

    capsys.readouterr()
    code = run_app(app, [str(a) for a in args])
    out, err = capsys.readouterr()
    return code, out, err


def _same_number(shown: str, typed: str) -> bool:
    a, b = float(shown), float(typed)
    return (math.isnan(a) and math.isnan(b)) or a == b


def test_every_numeric_option_of_every_command_is_in_the_table():
    """A new numeric option without a row here fails this test (so the table stays complete)."""
    import typing

    from llmcompress.cli import app

    seen = {}
    for info in app.registered_commands:
        flags = set()
        for hint in typing.get_type_hints(info.callback, include_extras=True).values():
            if typing.get_origin(hint) is not typing.Annotated:
                continue
            base, opt = typing.get_args(hint)[0], typing.get_args(hint)[1]
            types = set(typing.get_args(base)) or {base}  # Optional[int] -> {int, NoneType}
            # in Annotated form typer takes the first positional argument of typer.Option as the flag
            decls = [d for d in (getattr(opt, "default", None), *(getattr(opt, "param_decls", None) or ())) if isinstance(d, str) and d.startswith("--")]
            if decls and (types & {int, float} or decls[0] in STRING_NUMBERS):
                flags.add(decls[0])
        seen[info.name] = flags
    assert set(BAD) <= set(seen)
    assert seen == {name: set(BAD.get(name, {})) for name in seen}  # commands not in BAD (info, ...) have none


@pytest.mark.parametrize("cmd,flag,value", CASES, ids=[f"{c}{f}={v}" for c, f, v in CASES])
def test_out_of_range_number_exits_2_naming_flag_value_and_range(cmd, flag, value, tmp_path, capsys):
    base = [a for a in BASE[cmd] if not (flag in EXCLUSIVE and a == "--pareto")]
    out = tmp_path / "out"
    code, _, err = run_cli(capsys, cmd, *base, "--out", out, f"{flag}={value}")
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert code == 2 and len(lines) == 1, err
    line = lines[0]
    assert line.startswith("error: ") and flag in line, line
    if flag not in STRING_NUMBERS:
        assert re.search(r"must be [<>]=? \S+( and [<>]=? \S+)? \(got ", line), line  # the valid range
        assert _same_number(re.search(r"\(got ([^)]+)\)", line).group(1), value), line  # the value
    assert not out.exists()


def test_spec_file_values_meet_the_same_ranges(tmp_path, capsys):
    cases = [
        ("collapse", "population: 0\n", "--population must be >= 1"),
        ("collapse", "kl_topk: -1\n", "kl_topk must be >= 1"),
        ("collapse", "p_crossover: 1.5\n", "p_crossover must be >= 0 and <= 1"),
        ("collapse", "generations: '4'\n", "--generations must be an integer"),
        ("collapse", "alpha_grid: [0.0, 2.0, 1.0]\n", "alpha_grid must be >= 0 and <= 1 (got 2.0)"),
        ("collapse", "save: banana\n", "--save 'banana'"),
        ("collapse", "prefix_cache_gb: -1\n", "prefix_cache_gb must be >= 0"),
        ("collapse", "fitness_dtype: float8\n", "fitness_dtype 'float8' is not auto, float32 or bfloat16"),
        ("nas", "lr: -0.1\n", "lr must be > 0"),
        ("nas", "checkpoint_every: 0\n", "checkpoint_every must be >= 1"),
        ("nas", "min_keep_frac: 0\n", "min_keep_frac must be > 0"),
        ("nas", "search_steps: -1\n", "search_steps must be >= 0"),
    ]
    for cmd, text, needle in cases:
        spec = tmp_path / "spec.yaml"
        spec.write_text(text)
        code, _, err = run_cli(capsys, cmd, *BASE[cmd], "--spec", spec, "--out", tmp_path / "out")
        assert code == 2 and needle in err and len(err.strip().splitlines()) == 1, (text, err)
        assert not (tmp_path / "out").exists()


def test_valid_edge_values_pass_the_range_check():
    """0 where it is documented (skips, all tokens, auto threads) and the bounds themselves are accepted."""
    from llmcompress.collapse.config import CollapseConfig
    from llmcompress.distill.config import DistillConfig
    from llmcompress.eval.report import EvalSpec
    from llmcompress.nas.config import NasConfig

    EvalSpec(max_tokens=0, seq_len=2, batch_size=1, limit=0.5).validate()
    CollapseConfig(eval_tokens=0, piqa_limit=0, refine_steps=0, tune_steps=0, max_cache_gb=0.0, seed=2**32 - 1, save="2,3",
                   prefix_cache_gb=0.0, budget_minutes=0.5, fitness_dtype="bfloat16").validate()
    DistillConfig(keep_layers=1, e2e_steps=0, eval_tokens=0, ce_weight=0.0, phase1_fraction=1.0, threads=1).validate()
    NasConfig(target_bits=2.0, group_size=0, eval_tokens=0, refine_evals=0, bits=[2, 16]).validate()


@pytest.mark.parametrize(
    "args,needle",
    [
        (["eval", "{model}", "--ppl", "wikitext2", "--max-tokens", "-5", "--no-speed"], "--max-tokens must be >= 0"),
        (["eval", "{model}", "--batch-size", "0", "--no-speed"], "--batch-size must be >= 1"),
        (["eval", "{model}", "--tasks", "piqa", "--limit", "-3", "--no-speed"], "--limit must be > 0"),
        (["collapse", "{model}", "--pareto", "--max-cache-gb", "-1"], "--max-cache-gb must be >= 0"),
        (["collapse", "{model}", "--pareto", "--save", "banana"], "--save 'banana' is not knee, all or a list"),
    ],
)
def test_probe_cases_in_a_real_process(args, needle, tiny_hf_dir, tmp_path):
    """The fault probe's cases (issue 25, findings 5 and 11) through `python -m llmcompress`."""
    import os
    import subprocess
    import sys

    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "llmcompress", *[a.format(model=tiny_hf_dir) for a in args], "--out", str(out)]
    env = dict(os.environ, LLMCOMPRESS_CACHE_DIR=str(tmp_path / "cache"))
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], proc.stderr
    assert not out.exists()


def test_every_numeric_config_field_has_a_range():
    """Search-spec keys without a CLI flag are numbers too: each typed config's RANGES covers all of them."""
    import dataclasses
    import re

    from llmcompress.collapse import config as collapse_config
    from llmcompress.distill import config as distill_config
    from llmcompress.eval import report
    from llmcompress.nas import config as nas_config

    for cls, ranges in [(collapse_config.CollapseConfig, collapse_config.RANGES), (nas_config.NasConfig, nas_config.RANGES),
                        (distill_config.DistillConfig, distill_config.RANGES), (report.EvalSpec, report.RANGES)]:
        numeric = {f.name for f in dataclasses.fields(cls) if re.search(r"\b(int|float)\b", str(f.type)) and f.name != "version"}
        assert numeric == set(ranges), (cls.__name__, numeric ^ set(ranges))
