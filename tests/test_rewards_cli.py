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
        (
            ["rewards", "score", "numeric", "3", "--kw", "atol=abc"],
            r"--kw atol=abc: .* takes a float .* --kw atol=1e-06",
        ),
        (["rewards", "score", "numeric", "3", "--kw", "atol=true"], r"--kw atol=true: .* takes a float"),
        (["rewards", "score", "numeric", "3", "--kw", "tag=3"], r"--kw tag=3: .* takes a str"),
        (["rewards", "score", "numeric", "3", "--kw", "atl=1"], r"--kw: .* no keyword 'atl' \(did you mean 'atol'"),
        (["serve-rewards", "--rewards", "numeric", "--port", "99999"], r"--port 99999 is not a TCP port; use 1-65535"),
        (["serve-rewards", "--rewards", "numeric", "--port", "-1"], r"--port -1 is not a TCP port"),
        (["serve-rewards", "--rewards", "numeric", "--max-batch", "0"], r"--max-batch 0 must be >= 1"),
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


def test_kw_of_the_right_type_still_scores(parser, capsys):
    # an int where a float is expected is fine (JSON 1 -> atol=1): |3.5 - 3| <= 1 scores 1
    args = parser.parse_args(["rewards", "score", "numeric", "3.5", "--kw", "atol=1", "--field", "answers=3"])
    assert args.func(args) == 0 and capsys.readouterr().out.strip() == "1"


def test_unreachable_reward_url_is_one_line_through_the_cli(capsys):
    # nothing listens on port 9 (discard) of the loopback: the CLI prints one line naming the URL, exit 2
    from mmgrpo.cli import main
    from rewards import client

    real = client.HttpReward.__init__

    def quick(self, url, **kw):  # the CLI's default retries with 0.5 s backoff; keep the test fast
        real(self, url, retries=1, backoff=0.01, timeout=2)

    mp = pytest.MonkeyPatch()
    mp.setattr(client.HttpReward, "__init__", quick)
    try:
        assert main(["rewards", "score", "http://127.0.0.1:9/numeric", "3"]) == 2
    finally:
        mp.undo()
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert "http://127.0.0.1:9/numeric unreachable after 2 attempts" in err and "serve-rewards" in err
