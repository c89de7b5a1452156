"""Bad checkpoints fail at load with an error that names the problem; the CLI works end to end."""

from __future__ import annotations

import json
import shutil

import mlx.core as mx
import pytest
from sanctum.engine.model.checkpoint import CheckpointError
from sanctum.engine.model.drafter import load_drafter
from sanctum.engine.model.target import load_target


@pytest.fixture(scope="module")
def pair(make_pair):
    target_dir, drafter_dir = make_pair("hybrid", "dflash")
    return target_dir, drafter_dir, load_target(target_dir)


def broken_copy(src, tmp_path, edit_config=None, edit_weights=None):
    dst = tmp_path / "ckpt"
    shutil.copytree(src, dst)
    if edit_config:
        cfg = json.loads((dst / "config.json").read_text())
        edit_config(cfg)
        (dst / "config.json").write_text(json.dumps(cfg))
    if edit_weights:
        weights = dict(mx.load(str(dst / "model.safetensors")))
        edit_weights(weights)
        mx.save_safetensors(str(dst / "model.safetensors"), weights)
    return dst


def _del(*keys):
    def edit(d):
        for k in keys:
            node = d
            *path, last = k.split(".")
            for p in path:
                node = node[p]
            del node[last]

    return edit


@pytest.mark.parametrize(
    "edit, message",
    [
        (_del("hidden_size"), "missing hidden_size"),
        (_del("dflash_config.target_layer_ids"), "dflash_config.target_layer_ids"),
        (_del("block_size"), "block_size"),
        (
            lambda c: c["dflash_config"].update(target_layer_ids=[1, 99]),
            "beyond the target's depth",
        ),
        (lambda c: c.update(hidden_size=256), "hidden_size 256 != target hidden size 128"),
        (lambda c: c.update(vocab_size=1000), "vocab_size 1000 != target vocab"),
        (lambda c: c.update(architectures=["MedusaModel"]), "unknown architecture"),
        (lambda c: c["dflash_config"].update(mask_token_id=10**6), "mask_token_id"),
    ],
)
def test_bad_drafter_config_is_named(pair, tmp_path, edit, message):
    _, drafter_dir, target = pair
    bad = broken_copy(drafter_dir, tmp_path, edit_config=edit)
    with pytest.raises(CheckpointError, match=message):
        load_drafter(bad, target)


def test_drafter_missing_weights_are_named(pair, tmp_path):
    _, drafter_dir, target = pair
    bad = broken_copy(
        drafter_dir, tmp_path, edit_weights=lambda w: w.pop("layers.0.self_attn.q_proj.weight")
    )
    with pytest.raises(CheckpointError, match="missing weights layers.0.self_attn.q_proj.weight"):
        load_drafter(bad, target)
    (bad / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="missing weights"):
        load_drafter(bad, target)


def test_drafter_wrong_weight_shape_is_named(pair, tmp_path):
    _, drafter_dir, target = pair
    bad = broken_copy(drafter_dir, tmp_path, edit_weights=lambda w: w.update(
        {"fc.weight": mx.zeros((128, 64))}))  # fmt: skip
    with pytest.raises(CheckpointError, match="fc.weight has shape"):
        load_drafter(bad, target)


def test_bad_targets_are_named(pair, tmp_path):
    target_dir, _, _ = pair
    bad = broken_copy(target_dir, tmp_path, edit_config=lambda c: c.update(model_type="gpt2"))
    with pytest.raises(CheckpointError, match="unsupported architecture model_type='gpt2'"):
        load_target(bad)
    (bad / "config.json").unlink()
    with pytest.raises(CheckpointError, match="missing config.json"):
        load_target(bad)
    bad2 = tmp_path / "noweights"
    shutil.copytree(target_dir, bad2)
    (bad2 / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="missing weights"):
        load_target(bad2)
    with pytest.raises(CheckpointError, match="not in the local Hugging Face cache"):
        load_target("no-such-org/no-such-model")


def test_cli_generate_json(make_pair, capsys):
    from sanctum.cli import main

    target_dir, drafter_dir = make_pair("hybrid", "dflash")
    args = ["generate", "--model", str(target_dir), "--drafter", str(drafter_dir),
            "--prompt", "def fibonacci(n):", "--max-tokens", "12", "--json"]  # fmt: skip
    assert main(args) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert len(out["tokens"]) == out["completion_tokens"] <= 12
    assert out["rounds"] and {"bs", "accepted", "committed"} <= set(out["rounds"][0])
    assert out["tau"] >= 1.0 and isinstance(out["text"], str)
    # plain decoding gives the same greedy tokens
    assert main(args[:4] + ["none"] + args[5:]) == 0
    plain = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert plain["tokens"] == out["tokens"] and plain["tau"] is None


def test_cli_generate_verbose_text_on_stdout_rounds_on_stderr(make_pair, capsys):
    """--verbose: stdout is the text (as --json gives it), and stderr has one round line per
    round, each on its own line, so on a terminal no round line begins mid-text."""
    import contextlib
    import io
    import re

    from sanctum.cli import main

    target_dir, drafter_dir = make_pair("hybrid", "dflash")
    args = ["generate", "--model", str(target_dir), "--drafter", str(drafter_dir),
            "--prompt", "def fibonacci(n):", "--max-tokens", "12"]  # fmt: skip
    assert main([*args, "--json"]) == 0
    want = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert main([*args, "--verbose"]) == 0
    out, err = capsys.readouterr()
    assert out == want["text"] + "\n"
    rounds = [line for line in err.splitlines() if "bs=" in line]
    assert len(rounds) == len(want["rounds"])
    pattern = r"bs=\d+ accepted=\d+ committed=\d+ completion_tokens=\d+"
    assert all(re.fullmatch(pattern, line) for line in rounds), rounds
    # both on one terminal: every round line whole, the text in one piece
    screen = io.StringIO()
    with contextlib.redirect_stdout(screen), contextlib.redirect_stderr(screen):
        assert main([*args, "--verbose"]) == 0
    lines = screen.getvalue().splitlines()
    assert sum(bool(re.fullmatch(pattern, line)) for line in lines) == len(want["rounds"])
    assert want["text"] + "\n" in screen.getvalue()


def test_cli_reports_bad_flags(make_pair, capsys):
    from sanctum.cli import main

    target_dir, drafter_dir = make_pair("hybrid", "dflash")
    rc = main(["generate", "--model", str(target_dir), "--drafter", str(drafter_dir),
               "--prompt", "x", "--top-p", "1.5"])  # fmt: skip
    assert rc == 2 and "top_p" in capsys.readouterr().err


def test_hub_id_resolves_through_local_cache_offline(make_pair, tmp_path, monkeypatch):
    """A hub id already in the local Hugging Face cache loads with no network access."""
    import huggingface_hub.constants as hf_constants

    target_dir, drafter_dir = make_pair("hybrid", "dflash")
    cache = tmp_path / "hub"
    for repo, src in (
        ("sanctum-test/tiny-target", target_dir),
        ("sanctum-test/tiny-drafter", drafter_dir),
    ):
        root = cache / f"models--{repo.replace('/', '--')}"
        shutil.copytree(src, root / "snapshots" / ("0" * 40))
        (root / "refs").mkdir()
        (root / "refs" / "main").write_text("0" * 40)
    monkeypatch.setattr(hf_constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    target = load_target("sanctum-test/tiny-target")
    drafter = load_drafter("sanctum-test/tiny-drafter", target)
    assert target.num_layers == 8 and drafter.block_size == 8
