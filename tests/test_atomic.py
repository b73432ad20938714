"""io/atomic.py: final files get normal permissions, a failed writer leaves nothing behind."""

from __future__ import annotations

import os
import stat

import pytest

from llmcompress.io.atomic import atomic_dir, atomic_path, write_json


@pytest.fixture
def umask022():
    old = os.umask(0o022)
    yield
    os.umask(old)


def _mode(p) -> int:
    return stat.S_IMODE(os.stat(p).st_mode)


def test_saved_checkpoint_files_are_0644_and_dirs_0755(tmp_path, umask022):
    from conftest import tiny_model

    from llmcompress.io.checkpoint import save_checkpoint

    out = save_checkpoint(tiny_model("llama", layers=2), None, tmp_path / "ckpt", manifest={"method": "test"})
    assert _mode(out) == 0o755
    files = sorted(p for p in out.rglob("*") if p.is_file())
    assert {p.name for p in files} >= {"model.safetensors", "llmcompress.json", "config.json"}
    assert {p.name: _mode(p) for p in files} == {p.name: 0o644 for p in files}


def test_collapse_front_files_are_0644(tmp_path, umask022):
    from llmcompress.collapse.export import plot_front, write_front

    recs = [{"name": "a", "layers": 3, "kl_calib": 0.1, "kl_val": 0.2}, {"name": "b", "layers": 2, "kl_calib": 0.3, "kl_val": 0.4}]
    write_front(tmp_path, recs, [], {"model": "m"})
    plot_front(tmp_path / "pareto.png", recs, [], "t")
    assert {p.name: _mode(p) for p in tmp_path.iterdir()} == {"pareto.json": 0o644, "pareto.csv": 0o644, "pareto.png": 0o644}
    assert (tmp_path / "pareto.png").read_bytes()[:4] == b"\x89PNG"  # savefig saw the .png suffix


def test_modes_follow_the_umask(tmp_path):
    old = os.umask(0o077)
    try:
        write_json(tmp_path / "x.json", {"a": 1})
        with atomic_dir(tmp_path / "d") as d:
            (d / "f").write_text("x")
    finally:
        os.umask(old)
    assert _mode(tmp_path / "x.json") == 0o600
    assert _mode(tmp_path / "d") == 0o700


def test_a_failing_writer_leaves_no_temp_and_no_final_file(tmp_path):
    import torch

    target = tmp_path / "state.pt"
    with pytest.raises(RuntimeError), atomic_path(target) as tmp:
        torch.save({"x": torch.ones(3)}, tmp)
        assert tmp.is_file() and tmp.parent == tmp_path and tmp.suffix == ".pt"
        raise RuntimeError("writer failed")
    assert list(tmp_path.iterdir()) == []


def test_a_failing_writer_keeps_the_previous_file(tmp_path):
    import numpy as np

    target = tmp_path / "ids.npy"
    with atomic_path(target) as tmp:
        np.save(tmp, np.arange(4))  # np.save appends .npy unless the name ends with it
    assert list(tmp_path.iterdir()) == [target]
    with pytest.raises(KeyboardInterrupt), atomic_path(target) as tmp:
        np.save(tmp, np.arange(9))
        raise KeyboardInterrupt
    assert list(tmp_path.iterdir()) == [target]
    assert np.load(target).tolist() == [0, 1, 2, 3]


def test_zip_and_unzip_outputs_have_normal_modes(tiny_hf_dir, tmp_path, umask022):
    from llmcompress.lossless.container import unzip_checkpoint, zip_checkpoint

    zip_checkpoint(tiny_hf_dir, tmp_path / "z")
    unzip_checkpoint(tmp_path / "z", tmp_path / "u")
    for root in (tmp_path / "z", tmp_path / "u"):
        assert _mode(root) == 0o755
        modes = {p.name: _mode(p) for p in root.rglob("*")}
        assert modes and all(m == (0o755 if (root / n).is_dir() else 0o644) for n, m in modes.items()), modes


def test_a_full_disk_is_one_line_and_exit_2_and_leaves_nothing(tmp_path, capsys):
    import errno

    from llmcompress.errors import DiskFull, UserError

    def full(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(DiskFull) as info, atomic_path(tmp_path / "model.safetensors") as tmp:
        tmp.write_bytes(b"half")
        full()
    exc = info.value
    assert isinstance(exc, UserError) and exc.exit_code == 2 and isinstance(exc, OSError) and exc.errno == errno.ENOSPC
    assert "no space left" in exc.one_line() and str(tmp_path) in exc.one_line()
    with pytest.raises(DiskFull), atomic_dir(tmp_path / "ckpt") as d:
        (d / "config.json").write_text("{}")
        full()
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(ValueError), atomic_path(tmp_path / "x.json"):  # other errors pass through unchanged
        raise ValueError("not a disk error")


def test_a_full_disk_while_appending_a_log_line_is_exit_2(tmp_path, monkeypatch):
    import errno

    from llmcompress.errors import DiskFull
    from llmcompress.io.atomic import append_jsonl

    def full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(DiskFull, match="train_log.jsonl"):
        append_jsonl(tmp_path / "train_log.jsonl", {"step": 1})
