"""The pretraining programs' output folder (mmgrpo_shapes/programs/outdir.py): never another run's, saved whole."""

import pytest

from mmgrpo_shapes.programs import pretrain_t2i, pretrain_video, pretrain_vlm
from mmgrpo_shapes.programs.outdir import claim, write_whole


def test_claim_takes_a_new_or_empty_folder(tmp_path):
    assert claim(tmp_path / "new", False, "prog") == tmp_path / "new"
    (tmp_path / "empty").mkdir()
    assert claim(tmp_path / "empty", False, "prog") == tmp_path / "empty"


def test_claim_refuses_a_folder_that_holds_a_model_in_one_line(tmp_path, capsys):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(SystemExit) as err:
        claim(tmp_path, False, "pretrain_vlm")
    assert err.value.code == 2
    msg = capsys.readouterr().err
    assert msg.count("\n") == 1 and f"--out {tmp_path}" in msg and "config.json" in msg and "--overwrite" in msg
    assert claim(tmp_path, True, "pretrain_vlm") == tmp_path  # asked for: allowed
    (tmp_path / "file").write_text("x")
    with pytest.raises(SystemExit):
        claim(tmp_path / "file", True, "prog")


@pytest.mark.parametrize(
    "main, argv",
    [
        (pretrain_vlm.main, ["--task", "vqa"]),
        (pretrain_video.main, []),
        (pretrain_t2i.main, []),
    ],
)
def test_every_pretraining_program_refuses_before_training(tmp_path, capsys, main, argv):
    (tmp_path / "model.safetensors").write_bytes(b"weights of another run")
    with pytest.raises(SystemExit) as err:
        main([*argv, "--out", str(tmp_path), "--minutes", "0.01"])
    assert err.value.code == 2 and "--overwrite" in capsys.readouterr().err
    assert (tmp_path / "model.safetensors").read_bytes() == b"weights of another run"


def test_write_whole_swaps_in_a_complete_folder_and_keeps_the_old_one_on_failure(tmp_path):
    out = tmp_path / "model"
    write_whole(out, lambda d: (d / "weights").write_text("first"))
    write_whole(out, lambda d: (d / "weights").write_text("second"))
    assert (out / "weights").read_text() == "second"

    def crash(d):
        (d / "weights").write_text("half")
        raise RuntimeError("killed mid-save")

    with pytest.raises(RuntimeError):
        write_whole(out, crash)
    assert (out / "weights").read_text() == "second"  # the previous save, whole
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]  # no partial folder left beside it
