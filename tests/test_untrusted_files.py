"""Files from an output or model directory are data, never code: planted pickles must not run (issue 25,
findings 2 and 3). Each payload's __reduce__ would create a marker file if it were ever unpickled."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys

import pytest

ENV = {**os.environ, "LLMCOMPRESS_PROGRESS": "0"}


class Payload:
    """Unpickling this runs `touch MARKER` (what a hostile file in a shared output directory would do)."""

    def __init__(self, marker) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def cli(*args):
    return subprocess.run([sys.executable, "-m", "llmcompress", *map(str, args)], capture_output=True, text=True, env=ENV, timeout=300)


def one_line_error(r, needle: str) -> str:
    assert r.returncode == 2, (r.returncode, r.stderr)
    lines = [s for s in r.stderr.splitlines() if s.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:"), r.stderr
    assert needle in lines[0], lines[0]
    return lines[0]


def test_payload_really_runs_when_unpickled(tmp_path):
    """The payload is live: the tests below would see its marker if anything unpickled it."""
    marker = tmp_path / "ran"
    pickle.loads(pickle.dumps(Payload(marker)))
    assert marker.exists()


@pytest.fixture
def tiny_spec(tmp_path):
    text = tmp_path / "calib.txt"
    text.write_text(("The quick brown fox jumps over the lazy dog. " * 40 + "\n\n") * 6)
    spec = tmp_path / "tiny.yaml"
    spec.write_text(f"calib_source: {text}\nseq_len: 32\ncalib_tokens: 128\nval_tokens: 64\npopulation: 4\ngenerations: 1\n"
                    "eval_tokens: 0\npiqa_limit: 0\nbaselines: [shortgpt]\nmin_layers: 3\n")
    return spec


def test_collapse_resume_never_unpickles_the_state(tmp_path, tiny_hf_dir, tiny_spec):
    out, marker = tmp_path / "run", tmp_path / "pwned"
    out.mkdir()
    (out / "search_state.pkl").write_bytes(pickle.dumps({"model": str(tiny_hf_dir), "algorithm": Payload(marker)}))
    one_line_error(cli("collapse", tiny_hf_dir, "--spec", tiny_spec, "--pareto", "--resume", "--out", out), "no longer reads")
    assert not marker.exists()


def test_collapse_state_file_holding_a_pickle_is_refused(tmp_path):
    from llmcompress.collapse.config import CollapseConfig
    from llmcompress.collapse.search import STATE_FILE, load_state
    from llmcompress.errors import UserError

    marker = tmp_path / "pwned"
    (tmp_path / STATE_FILE).write_bytes(pickle.dumps({"model": "tiny", "algorithm": Payload(marker)}))
    with pytest.raises(UserError, match="cannot read the search state"):
        load_state(tmp_path, CollapseConfig(), "tiny")
    assert not marker.exists()


def test_nas_resume_reads_tensors_only(tmp_path):
    import torch
    from conftest import tiny_nas_setup

    from llmcompress.errors import UserError
    from llmcompress.nas.search import search_joint

    ids = torch.randint(3, 256, (8, 32), generator=torch.Generator().manual_seed(0))
    model, cfg, space, costs = tiny_nas_setup(ids)
    cfg = __import__("dataclasses").replace(cfg, search_steps=None)  # a gradient phase, which reads the state
    marker = tmp_path / "pwned"
    torch.save({"fingerprint": cfg.fingerprint(), "net": Payload(marker)}, tmp_path / "search_state_joint.pt")
    with pytest.raises(UserError, match="search state of an older llmcompress"):  # a .pt state is never read
        search_joint(model, space, costs, cfg, ids, tmp_path, True)
    (tmp_path / "search_state_joint.json").write_bytes(pickle.dumps({"fingerprint": cfg.fingerprint(), "net": Payload(marker)}))
    with pytest.raises(UserError, match="cannot read the search state"):
        search_joint(model, space, costs, cfg, ids, tmp_path, True)
    assert not marker.exists()


def test_nas_resume_of_an_old_pt_state_is_one_line(tmp_path, tiny_hf_dir):
    """`nas --resume` on a run directory of an older llmcompress (`.pt` state): one line, exit 2, --overwrite named."""
    out = tmp_path / "run"
    out.mkdir()
    (out / "search_state_joint.pt").write_bytes(b"old")
    spec = tmp_path / "s.yaml"
    spec.write_text("seq_len: 32\nbatch_size: 2\ncontext_len: 32\nrefine_evals: 0\nquant_method: rtn\nsearch_steps: 2\n")
    one_line_error(cli("nas", tiny_hf_dir, "--spec", spec, "--target-bits", "4", "--train-tokens", "128", "--eval-tokens", "0",
                       "--baselines", "", "--resume", "--out", out), "start the search afresh with --overwrite")
    assert not (out / "arch.json").exists() and not (out / "hf").exists()


@pytest.fixture
def pickle_only_dir(tmp_path, tiny_hf_dir):
    """The tiny model with its weights as pytorch_model.bin only."""
    import torch
    from safetensors.torch import load_file

    sd = load_file(tiny_hf_dir / "model.safetensors")
    (tiny_hf_dir / "model.safetensors").unlink()
    torch.save(sd, tiny_hf_dir / "pytorch_model.bin")
    return tiny_hf_dir


def test_pickle_only_model_is_refused_and_allow_pickle_loads_tensors_only(tmp_path, pickle_only_dir, monkeypatch):
    import torch

    from llmcompress.errors import UserError
    from llmcompress.io.load import load_model

    line = one_line_error(cli("info", pickle_only_dir), "only pickle weights (pytorch_model.bin)")
    assert "--allow-pickle" in line and "safetensors" in line
    assert load_model(str(pickle_only_dir), allow_pickle=True).config.num_hidden_layers == 4  # plain tensors load
    marker = tmp_path / "pwned"  # a hostile .bin: refused without the flag, and not run with it
    torch.save({"model.embed_tokens.weight": Payload(marker)}, pickle_only_dir / "pytorch_model.bin")
    with pytest.raises(UserError, match="only pickle weights"):
        load_model(str(pickle_only_dir))
    one_line_error(cli("info", pickle_only_dir, "--allow-pickle"), "refused to unpickle")
    assert not marker.exists()
