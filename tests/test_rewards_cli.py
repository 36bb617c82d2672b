"""The rewards CLI functions, called with parsed arguments (list, score, serve-rewards)."""

import argparse
import json

import numpy as np
import pytest
from PIL import Image

import rewards
from rewards import cli


@pytest.fixture
def parser():
    p = argparse.ArgumentParser(prog="mmgrpo")
    cli.add_subcommands(p.add_subparsers(dest="command", required=True))
    return p


def test_list_prints_every_reward(parser, capsys):
    args = parser.parse_args(["rewards", "list"])
    assert args.func(args) == 0
    out = capsys.readouterr().out
    for name in rewards.names():
        assert name in out


def test_score_text_with_fields_and_kwargs(parser, capsys):
    args = parser.parse_args(
        [
            "rewards",
            "score",
            "numeric",
            "<answer>3.14</answer>",
            "--kw",
            "atol=0.01",
            "--field",
            "answers=3.14159",
            "--json",
        ]
    )
    assert args.func(args) == 0
    assert json.loads(capsys.readouterr().out) == {"reward": "numeric", "score": 1.0}


def test_score_image_file(parser, capsys, tmp_path):
    path = tmp_path / "flat.png"
    Image.fromarray(np.full((16, 16, 3), 7, np.uint8)).save(path)
    args = parser.parse_args(["rewards", "score", "jpeg_compressibility", str(path), "a grey square"])
    assert args.func(args) == 0
    expect = rewards.load("jpeg_compressibility")([Image.open(path)]).item()
    assert float(capsys.readouterr().out) == pytest.approx(expect, rel=1e-5)


@pytest.mark.parametrize(
    "argv, match",
    [
        (["rewards", "score", "pickscor", "x.png", "p"], "did you mean 'pickscore'"),
        (["rewards", "score", "format", "x", "--kw", "mode"], "key=value"),
        (["rewards", "score", "jpeg_compressibility", "/no/such.png"], "not a file"),
        (["rewards", "score", "accuracy", "4"], "answers"),
    ],
)
def test_score_user_errors_are_one_line(parser, argv, match):
    args = parser.parse_args(argv)
    with pytest.raises(rewards.UserError, match=match) as info:
        args.func(args)
    assert "\n" not in str(info.value)


def test_serve_rewards_binds_and_stops(parser, monkeypatch, capsys):
    from rewards import server as server_mod

    seen, loaded = {}, {}

    def fake_serve_forever(self):
        seen.update(url=self.url, token=self.token)
        raise KeyboardInterrupt  # stands in for Ctrl-C right after binding

    def spy_load(name, **kw):  # record what each reward is loaded with; a rule reward stands in for the model
        loaded[name] = kw
        return rewards.load("format" if name == "aesthetic" else name, **kw if name != "aesthetic" else {})

    monkeypatch.setattr(server_mod.RewardServer, "serve_forever", fake_serve_forever)
    monkeypatch.setattr(server_mod, "load", spy_load)
    monkeypatch.setenv("MMGRPO_REWARDS_TOKEN", "from-env")
    args = parser.parse_args(
        ["serve-rewards", "--rewards", "format,wer,aesthetic", "--port", "0", "--device", "cuda:1", "--dtype", "bf16"]
    )
    assert args.host == "127.0.0.1"
    assert args.func(args) == 0
    assert seen["url"].startswith("http://127.0.0.1:") and "format, wer" in capsys.readouterr().out
    # --device/--dtype reach the model rewards only; the token falls back to $MMGRPO_REWARDS_TOKEN
    assert loaded == {"format": {}, "wer": {}, "aesthetic": {"device": "cuda:1", "dtype": "bf16"}}
    assert seen["token"] == "from-env"
    bad = parser.parse_args(["serve-rewards", "--rewards", "nope", "--port", "0"])
    with pytest.raises(rewards.UserError, match="unknown reward 'nope'"):
        bad.func(bad)
