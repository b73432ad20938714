"""A run that fails on bad input leaves no --out behind (issue 25, finding 10): `collapse --calib-data
latin1.txt` used to leave OUT/config.json (and `nas` with a measured LUT OUT/lut.json), so the corrected
rerun was refused with "already exists ... --overwrite"."""

from __future__ import annotations

import pytest


def run_cli(capsys, *args):
    from llmcompress.cli import app
    from llmcompress.cli._errors import run_app

    capsys.readouterr()
    code = run_app(app, [str(a) for a in args])
    return code, capsys.readouterr().err


@pytest.mark.parametrize("cmd", ["collapse", "nas", "distill"])
def test_undecodable_data_exits_2_and_leaves_no_out(cmd, tiny_hf_dir, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("LLMCOMPRESS_CACHE_DIR", str(tmp_path / "cache"))
    latin1 = tmp_path / "latin1.txt"
    latin1.write_bytes(("caf\xe9 na\xefve \xe0 la carte. " * 500).encode("latin-1"))
    spec = tmp_path / "spec.yaml"
    args = {
        "collapse": ["collapse", tiny_hf_dir, "--pareto", "--calib-data", latin1, "--spec", spec],
        "nas": ["nas", tiny_hf_dir, "--target-bits", "4", "--spec", spec],
        "distill": ["distill", tiny_hf_dir, "--keep-layers", "2", "--data", latin1, "--device", "cpu", "--eval-tokens", "0"],
    }[cmd]
    spec.write_text({"collapse": "min_layers: 3\n", "nas": f"calib_source: {latin1}\ncost_model: lut\ncontext_len: 16\n"}.get(cmd, ""))
    out = tmp_path / "out"
    code, err = run_cli(capsys, *args, "--out", out)
    assert code == 2 and "is not UTF-8 text" in err and len(err.strip().splitlines()) == 1, err
    assert not out.exists(), sorted(p.name for p in out.rglob("*"))
