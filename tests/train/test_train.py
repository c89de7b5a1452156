"""Training commands on tiny shapes (CPU): each runs a few steps and its loss falls; the drafter's
batched training forward equals the inference forward, so training and serving cannot drift."""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest
from sanctum.cli import main
from sanctum.engine.model.drafter import load_drafter
from sanctum.engine.model.target import load_target
from sanctum.tiny import (
    DRAFTER_LAYOUTS,
    TINY_TOKENIZER,
    drafter_config,
    write_random_drafter,
)
from sanctum.train.blocks import block_forward, target_pass
from sanctum.train.data import Corpus, build_corpus, function_pairs, is_holdout, stdlib_root
from sanctum.train.gdn import chunked_gdn

# three small, stable stdlib modules: enough text for a few steps
FILES = ["textwrap.py", "colorsys.py", "bisect.py"]


@pytest.fixture(scope="module")
def corpus_args():
    root = stdlib_root()
    return [a for f in FILES for a in ("--corpus", str(root / f))]


def _losses(out_dir) -> list[float]:
    log = json.loads((out_dir / "train_log.json").read_text())
    return [r["loss"] for r in log["train"]]


def test_tokenizer_command(tmp_path, corpus_args):
    out = tmp_path / "tok"
    assert main(["train", "tokenizer", "--out", str(out), "--vocab-size", "600", *corpus_args]) == 0
    tok = json.loads((out / "tokenizer.json").read_text())
    added = {t["content"] for t in tok["added_tokens"]}
    assert {"<|im_start|>", "<|im_end|>", "<think>", "</think>", "<|mask|>"} <= added
    config = json.loads((out / "tokenizer_config.json").read_text())
    assert "<|im_start|>" in config["chat_template"]


def test_chat_shaping_and_holdout():
    pairs = function_pairs((stdlib_root() / "textwrap.py").read_text())
    assert pairs and all(func.startswith(stub.split("\n")[0]) for stub, func in pairs)
    names = [f"mod{i}.py" for i in range(400)]
    held = [n for n in names if is_holdout(n)]
    assert 0 < len(held) < 60 and held == [n for n in names if is_holdout(n)]  # stable


def test_target_command_loss_falls(tmp_path, corpus_args):
    out = tmp_path / "target"
    argv = ["train", "target", "--tokenizer", str(TINY_TOKENIZER), "--out", str(out),
            "--hidden", "64", "--layers", "4", "--intermediate", "128", "--heads", "2",
            "--kv-heads", "1", "--gdn-key-heads", "1", "--gdn-value-heads", "2",
            "--gdn-head-dim", "32", "--steps", "40", "--batch", "4", "--seq-len", "64",
            "--lr", "3e-3", "--log-every", "1", "--eval-every", "0", "--dtype", "float32",
            "--no-compile", *corpus_args]  # fmt: skip
    assert main(argv) == 0
    losses = _losses(out)
    assert np.mean(losses[-5:]) < np.mean(losses[:5]) - 0.5
    target = load_target(out)  # loads through the real loader
    assert target.model_type == "qwen3_5" and sum(target.is_gdn) == 3


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory):
    from sanctum.tiny import make_tiny

    return make_tiny(tmp_path_factory.mktemp("pair"), "hybrid", "dflash", 0, 8)


def test_drafter_command_loss_falls(tmp_path, tiny_pair, corpus_args):
    target_dir, _ = tiny_pair
    out = tmp_path / "drafter"
    argv = ["train", "drafter", "--target", str(target_dir), "--out", str(out), "--layers", "2",
            "--head-dim", "32", "--taps", "1,3,5", "--steps", "30", "--batch", "4",
            "--seq-len", "64", "--rows-per-seq", "64", "--lr", "3e-3", "--regen", "4",
            "--regen-prompt", "16", "--regen-batch", "4", "--log-every", "1", "--distill", "0",
            "--eval-every", "0", "--dtype", "float32", "--no-compile", *corpus_args]  # fmt: skip
    assert main(argv) == 0
    losses = _losses(out)
    assert np.mean(losses[-5:]) < np.mean(losses[:5]) - 0.3
    target = load_target(target_dir)
    drafter = load_drafter(out, target)  # the written checkpoint loads unchanged
    assert drafter.cfg.target_layer_ids == (1, 3, 5)


def test_dflash2_long_packing_loss_falls(tmp_path, tiny_pair, corpus_args):
    """DFlash 2 training on long windows with regenerated spans (`train regen --spans`), a
    sliding window shorter than the window and is_causal false (the published layout): the loss
    falls, the selector learns, and the checkpoint drafts losslessly through the engine."""
    from sanctum.engine.decode.generate import generate
    from sanctum.engine.decode.sampling import SamplingParams

    target_dir, _ = tiny_pair
    corpus_args = [*corpus_args, "--corpus", str(stdlib_root() / "sched.py")]  # a held-out file
    assert is_holdout("sched.py")
    regen = tmp_path / "regen.npz"
    assert main(["train", "regen", "--target", str(target_dir), "--out", str(regen),
                 "--count", "8", "--holdout", "2", "--seq-len", "160", "--spans", "3",
                 "--new-tokens", "16", "--temperatures", "0,1", "--batch", "4", *corpus_args]) == 0  # fmt: skip
    out = tmp_path / "drafter2"
    argv = ["train", "drafter", "--target", str(target_dir), "--out", str(out), "--kind",
            "dflash2", "--sliding-window", "48", "--is-causal", "false", "--selector-rank", "16",
            "--selector-top-k", "8", "--layers", "2", "--head-dim", "32", "--taps", "1,3,5",
            "--steps", "30", "--batch", "4", "--seq-len", "160", "--rows-per-seq", "96",
            "--lr", "3e-3", "--regen-data", str(regen), "--log-every", "1", "--distill", "0",
            "--hard-labels", "data", "--eval-every", "15", "--dtype", "float32",
            "--no-compile", *corpus_args]  # fmt: skip
    assert main(argv) == 0
    log = json.loads((out / "train_log.json").read_text())
    for part, drop in (("draft_loss", 0.1), ("select_loss", 0.3)):  # the body's, the selector's
        losses = [r[part] for r in log["train"]]
        assert np.mean(losses[-5:]) < np.mean(losses[:5]) - drop, part
    assert {"regen_tau_b8", "regen_tau_t1_b16", "holdout_tau_b8"} <= set(log["eval"][-1])
    raw = json.loads((out / "config.json").read_text())
    assert raw["is_causal"] is False and raw["dflash_config"]["block_size"] == 8
    assert "block_size" not in raw  # the published DFlash 2 layout
    target = load_target(target_dir)
    drafter = load_drafter(out, target)
    assert drafter.cfg.is_v2 and drafter.cfg.sliding_window == 48
    book = drafter.head.candidate_selector.successor_codebook
    assert mx.abs(book).max().item() > 0.1  # moved from its 0.02-scale init
    prompt = list(range(20, 90))
    plain = [t for s in generate(target, prompt, max_tokens=24, eos_ids=set()) for t in s.tokens]
    steps = list(generate(target, prompt, drafter=drafter, sampling=SamplingParams(),
                          max_tokens=24, eos_ids=set()))  # fmt: skip
    assert [t for s in steps for t in s.tokens] == plain
    assert main(["train", "pack", "--target", str(target_dir), "--drafter", str(out),
                 "--out", str(tmp_path / "packed"), "--drafter-only"]) == 0  # fmt: skip
    packed = load_drafter(tmp_path / "packed" / "drafter", target)  # selector kept beside
    assert mx.allclose(packed.head.candidate_selector.successor_codebook, book, atol=1e-2).item()
    # calibration: fits the sampled proposal's temperature scale on the held-out regen rows
    from sanctum.train.calibrate import SCALES

    assert main(["train", "calibrate", "--target", str(target_dir), "--drafter",
                 str(tmp_path / "packed" / "drafter"), "--regen-data", str(regen), "--sequences",
                 "2", "--seq-len", "160", "--rows-per-seq", "64", "--write"]) == 0  # fmt: skip
    fitted = load_drafter(tmp_path / "packed" / "drafter", target).cfg.draft_temperature_scale
    assert fitted in SCALES


def test_fast_gdn_matches_mlx_lm(tiny_pair):
    target = load_target(tiny_pair[0])
    tokens = mx.array(
        np.random.default_rng(0).integers(0, target.vocab_size, (2, 40)).astype(np.int32)
    )
    ref_taps, ref_logits = target_pass(target, tokens, (1, 5))
    with chunked_gdn():
        taps, logits = target_pass(target, tokens, (1, 5))
    assert mx.allclose(taps, ref_taps, atol=1e-4, rtol=1e-4).item()
    assert mx.allclose(logits, ref_logits, atol=1e-4, rtol=1e-4).item()


@pytest.mark.parametrize("layout", ["tiny", *sorted(DRAFTER_LAYOUTS)])
def test_training_forward_equals_inference(tiny_pair, tmp_path, layout):
    """Blocks through the batched, masked training forward == DraftBody's cached inference forward
    (which the reference-parity tests pin to the DFlash authors' code), for each published layout
    (sliding windows per row, is_causal, DFlash 2's convolutions); blocks in one batch never see
    each other. Anchors before and well past the sliding window."""
    target_dir, drafter_dir = tiny_pair
    if layout != "tiny":
        raw = DRAFTER_LAYOUTS[layout](drafter_config("dflash", target_dir))
        drafter_dir = write_random_drafter(tmp_path / layout, raw, seed=5)
    target = load_target(target_dir)
    drafter = load_drafter(drafter_dir, target)
    body, head, cfg = drafter.body, drafter.head, drafter.cfg
    L = cfg.block_size
    S = 3 * (cfg.sliding_window or 16) + L
    anchors = [5, S // 2, S - L]  # the last two past the window
    tokens = mx.array(np.random.default_rng(1).integers(10, target.vocab_size, S).astype(np.int32))
    _, taps = target.forward(tokens, target.make_cache(), cfg.target_layer_ids)  # [S, W]
    batched_taps, _ = target_pass(target, tokens[None], cfg.target_layer_ids)
    assert mx.allclose(batched_taps[0], taps, atol=1e-4).item()

    mask_embed = target.embed_tokens(mx.array([cfg.mask_token_id]))
    blocks = [
        mx.concatenate([target.embed_tokens(tokens[p : p + 1]), mx.repeat(mask_embed, L - 1, 0)])
        for p in anchors
    ]
    hidden = block_forward(body, taps[None], mx.stack(blocks)[None], mx.array([anchors]))
    for n, (p, block) in enumerate(zip(anchors, blocks)):
        ref = body(block[None], p, taps[None, :p], body.make_cache())  # [1, L, H]
        ref_logits = head.logits(ref[0, 1:])
        logits = head.logits(hidden[0, n, 1:])
        assert mx.allclose(hidden[0, n], ref[0], atol=1e-4, rtol=1e-4).item(), (layout, p)
        assert mx.allclose(logits, ref_logits, atol=1e-3, rtol=1e-3).item()
        assert (mx.argmax(logits, -1) == mx.argmax(ref_logits, -1)).all().item()


def test_corpus_roundtrip(tmp_path):
    corpus = build_corpus(TINY_TOKENIZER, [stdlib_root() / "colorsys.py"])
    again = Corpus.load(corpus.save(tmp_path / "c.npz"))
    assert np.array_equal(again.train, corpus.train) and again.meta == corpus.meta


@pytest.mark.parametrize("aligned", [0.0, 0.9])
def test_chunked_gdn_values_and_gradients(aligned):
    """The chunked rule against mlx-lm's per-token one, in value and gradient; `aligned` keys
    (each a shared direction plus noise, as trained layers come to have) are the case a
    power-series inverse gets wrong."""
    from mlx import nn
    from mlx_lm.models.gated_delta import compute_g, gated_delta_ops, normalize_qk
    from sanctum.train.gdn import chunked_gated_delta

    mx.random.seed(0)
    B, T, Hk, Dk, Hv, Dv = 2, 139, 2, 16, 4, 16  # T not a multiple of the chunk: padding path
    keys = aligned * mx.random.normal((1, 1, Hk, Dk)) + (1 - aligned) * mx.random.normal(
        (B, T, Hk, Dk)
    )
    q, k = normalize_qk(mx.random.normal((B, T, Hk, Dk)), keys, inv_scale=Dk**-0.5, eps=1e-6)
    v, a, b = (
        mx.random.normal((B, T, Hv, Dv)),
        mx.random.normal((B, T, Hv)),
        mx.random.normal((B, T, Hv)),
    )
    A_log, dt = mx.log(mx.random.uniform(0, 16, (Hv,))), mx.ones(Hv)
    if aligned:  # slow decay and beta near 1: a chunk's keys interact over all its rows
        A_log, dt, b = mx.log(mx.random.uniform(1e-3, 1e-2, (Hv,))), -4 * mx.ones(Hv), b + 3
    s0 = mx.random.normal((B, Hv, Dv, Dk)) * 0.1

    def ref(q, k, v, a, b, s0):
        return gated_delta_ops(q, k, v, compute_g(A_log, a, dt), mx.sigmoid(b), s0)

    def mine(q, k, v, a, b, s0):
        log_g = -mx.exp(A_log) * nn.softplus(a + dt)
        return chunked_gated_delta(q, k, v, log_g, mx.sigmoid(b), s0, chunk=64)

    for got, want in zip(mine(q, k, v, a, b, s0), ref(q, k, v, a, b, s0)):
        assert mx.allclose(got, want, atol=1e-4, rtol=1e-4).item()
    # inference on the CPU takes LAPACK's triangular inverse (no gradient): the same values
    log_g = -mx.exp(A_log) * nn.softplus(a + dt)
    lapack = chunked_gated_delta(q, k, v, log_g, mx.sigmoid(b), s0, chunk=64, lapack=True)
    for got, want in zip(lapack, ref(q, k, v, a, b, s0)):
        assert mx.allclose(got, want, atol=1e-4, rtol=1e-4).item()
    args = (q, k, v, a, b, s0)
    grads = [mx.grad(lambda *x, f=f: (f(*x)[0] ** 2).sum() + f(*x)[1].sum(), argnums=tuple(range(6)))(*args)
             for f in (mine, ref)]  # fmt: skip
    for got, want in zip(*grads):
        assert mx.allclose(got, want, atol=1e-4, rtol=1e-3).item()


def test_pack_loads_small_and_close(tmp_path, tiny_pair):
    """A packed pair loads through the real loaders (float32 on the CPU) and stays close."""
    target_dir, drafter_dir = tiny_pair
    assert main(["train", "pack", "--target", str(target_dir), "--drafter", str(drafter_dir),
                 "--out", str(tmp_path), "--target-bits", "8"]) == 0  # fmt: skip
    ref_t, packed_t = load_target(target_dir), load_target(tmp_path / "target")
    assert packed_t.embed_tokens.weight.dtype == mx.float32
    tokens = mx.array(np.arange(20, 60).astype(np.int32))
    _, ref_taps = ref_t.forward(tokens, ref_t.make_cache(), (1, 3))
    _, taps = packed_t.forward(tokens, packed_t.make_cache(), (1, 3))
    assert mx.abs(taps - ref_taps).max().item() < 0.1 * mx.abs(ref_taps).max().item()
    ref_d = load_drafter(drafter_dir, ref_t)
    packed_d = load_drafter(tmp_path / "drafter", packed_t)
    assert packed_d.body.fc.weight.dtype == mx.float32
    rel = (
        mx.abs(packed_d.body.fc.weight - ref_d.body.fc.weight).max()
        / mx.abs(ref_d.body.fc.weight).max()
    )
    assert rel.item() < 0.02
    size = sum(f.stat().st_size for f in (tmp_path / "drafter").glob("*.safetensors"))
    assert size < 0.4 * sum(f.stat().st_size for f in drafter_dir.glob("*.safetensors"))


def test_regen_spans_are_engine_greedy(tiny_pair):
    """`sanctum train regen`'s spans: each greedy span is the engine's own greedy continuation of
    everything before it in the row (earlier spans included), stubs sit right before the spans,
    and sampled rows (temperature > 0) come out where greedy ones would not."""
    from sanctum.engine.decode.generate import generate
    from sanctum.engine.decode.sampling import SamplingParams
    from sanctum.train.regen import place_stubs, regenerate_rows, span_starts

    target = load_target(tiny_pair[0])
    rng = np.random.default_rng(0)
    starts = span_starts(96, 2, 10, np.random.default_rng(3))
    assert len(starts) == 2 and 16 <= starts[0] and starts[0] + 10 <= 48 <= starts[1] <= 86
    rows = rng.integers(10, target.vocab_size, (3, 40)).astype(np.int32)
    stubs = [{"ids": np.array([5, 6, 7], np.int32), "chat": False},
             {"ids": np.array([8, 9], np.int32), "chat": True}]  # fmt: skip
    kinds = place_stubs(rows, [20], rng, stubs, eot_id=3)
    assert kinds.tolist() == [0, 1, 2]
    assert rows[1, 16:20].tolist() == [3, 5, 6, 7] and rows[2, 17:20].tolist() == [3, 8, 9]

    windows = rng.integers(10, target.vocab_size, (5, 64)).astype(np.int32)
    out, gen, _, temps = regenerate_rows(target, windows, 2, 12, batch=4,
                                         rng=np.random.default_rng(1), temperatures=(0.0, 1.0))  # fmt: skip
    assert out.shape == windows.shape and temps.tolist() == [0.0, 1.0, 0.0, 1.0, 0.0]
    assert (out[~gen] == windows[~gen]).all() and gen.sum() == 5 * 2 * 12
    sampled_differs = False
    for row, mask, temp in zip(out, gen, temps):
        starts = [i for i in range(64) if mask[i] and (i == 0 or not mask[i - 1])]
        assert len(starts) == 2
        for start in starts:
            steps = generate(target, row[:start].tolist(), sampling=SamplingParams(),
                             max_tokens=12, eos_ids=set())  # fmt: skip
            greedy = [t for s in steps for t in s.tokens]
            if temp == 0:
                assert greedy == row[start : start + 12].tolist()
            else:
                sampled_differs |= greedy != row[start : start + 12].tolist()
    assert sampled_differs


def test_regen_review_rows_are_chats(tiny_pair):
    """`train regen --review`: every span is the assistant's reply in a review chat worded as
    bench multiturn asks (system turn, "Review this code" with a contiguous slice of one file,
    the assistant's header right before the span, the reply closed and the next user turn right
    after it); held-out rows show held-out files only; the spans are still the target's."""
    from sanctum.train.data import REVIEW_SYSTEM, TextTokenizer, render_chat, review_request
    from sanctum.train.regen import (
        MIN_SNIPPET,
        REVIEW,
        ReviewPieces,
        build_regen,
        place_reviews,
        place_stubs,
        regenerate_rows,
        review_pieces,
        review_starts,
    )

    stubs = [{"ids": np.array([5], np.int32), "chat": c} for c in (False, True)]
    plain = place_stubs(np.zeros((4, 40), np.int32), [20], np.random.default_rng(0), stubs, 3)
    assert plain.tolist() == [0, 1, 2, 0]  # without --review no row is a review chat

    # the placement alone, on pieces whose tokens say where they came from
    code = [np.arange(1000, 1300), np.arange(2000, 2900)]
    pieces = ReviewPieces(np.array([1, 2]), np.array([3, 4]), np.array([5, 6]), np.array([7]),
                          [c.astype(np.int32) for c in code])  # fmt: skip
    starts = review_starts(512, 2, 16, np.random.default_rng(0))
    assert starts[0] >= 120 and 256 + 120 <= starts[1] <= 512 - 16
    rows = np.full((3, 512), 9, np.int32)
    place_reviews(rows, starts, 16, np.random.default_rng(1), pieces, eot_id=8)
    for row in rows:
        s0, s1 = starts
        assert row[s0 - 2 : s0].tolist() == [5, 6]  # the assistant's header, then the reply
        first = row[: s0 - 2]
        head_at = len(first) - (first[::-1] < 1000).argmax()  # the code starts after head
        assert row[head_at - 5 : head_at].tolist() == [8, 1, 2, 3, 4]
        assert MIN_SNIPPET <= s0 - 2 - head_at <= 400
        after = row[s0 + 16 :]
        assert after[:3].tolist() == [7, 3, 4]  # the reply closed, the next user turn
        shown = row[s0 + 16 + 3 : s1 - 2]
        assert (np.diff(shown) == 1).all() and shown[0] // 1000 == shown[-1] // 1000
        assert row[s1 - 2 : s1].tolist() == [5, 6]

    # the real pieces: the chat template's own tokens around the code, files by split
    tok = TextTokenizer(TINY_TOKENIZER)
    root = stdlib_root()
    files = [root / "textwrap.py", root / "struct.py"]  # struct.py is held out
    assert is_holdout("struct.py") and not is_holdout("textwrap.py")
    train, held = review_pieces(tok, files), review_pieces(tok, files, holdout=True)
    assert len(train.code) == 1 and len(held.code) == 1
    with pytest.raises(ValueError, match="--review needs held-out .py files"):
        review_pieces(tok, files[:1], holdout=True)
    corpus = Corpus(np.arange(10, 400, dtype=np.int32), np.zeros(0, np.int32))
    with pytest.raises(ValueError, match="--prompt-len does not apply with --review"):
        build_regen(None, corpus, 1, 256, 1, 16, first=8, review=True)
    assert train.code[0].tolist() == tok.encode_batch([files[0].read_text()])[0]
    text = render_chat([{"role": "system", "content": REVIEW_SYSTEM},
                        {"role": "user", "content": review_request("x = 1")}])  # fmt: skip
    x = tok.encode_batch(["x = 1"])[0]
    ids = [*train.system, *train.head, *x, *train.foot]
    assert tok.encode_batch([text + "<|im_start|>assistant\n"])[0] == ids

    target = load_target(tiny_pair[0])
    windows = np.random.default_rng(2).integers(10, target.vocab_size, (3, 600)).astype(np.int32)
    out, gen, kinds, _ = regenerate_rows(target, windows, 2, 12, batch=2,
                                         rng=np.random.default_rng(3), review=train)  # fmt: skip
    assert (kinds == REVIEW).all() and gen.sum() == 3 * 2 * 12
    for row, mask in zip(out, gen):
        spans = [i for i in range(600) if mask[i] and not mask[i - 1]]
        assert all(row[s - len(train.foot) : s].tolist() == train.foot.tolist() for s in spans)


def test_drafter_fine_tune_from_packed_init(tmp_path, tiny_pair, corpus_args, capsys):
    """`--init` starts from a (packed) drafter, `--regen-data` trains on a regen file and
    evaluates its held-out rows; the result loads unchanged with the init's config."""
    target_dir, drafter_dir = tiny_pair
    packed = tmp_path / "packed"
    assert main(["train", "pack", "--target", str(target_dir), "--drafter", str(drafter_dir),
                 "--out", str(packed), "--target-bits", "8"]) == 0  # fmt: skip
    corpus_args = [*corpus_args, "--corpus", str(stdlib_root() / "struct.py")]  # a held-out file
    assert is_holdout("struct.py")
    regen = tmp_path / "regen.npz"
    assert main(["train", "regen", "--target", str(packed / "target"), "--out", str(regen),
                 "--count", "6", "--holdout", "2", "--seq-len", "64", "--spans", "1",
                 "--prompt-len", "16", "--new-tokens", "48", "--batch", "4", *corpus_args]) == 0  # fmt: skip
    with np.load(regen) as z:
        assert z["train"].shape == (6, 64) and z["holdout"].shape == (2, 64)
    short = tmp_path / "short.npz"  # a prompt near the start, then the target's reply
    assert main(["train", "regen", "--target", str(packed / "target"), "--out", str(short),
                 "--count", "5", "--holdout", "2", "--seq-len", "40", "--spans", "1",
                 "--prompt-len", "12", "--new-tokens", "28", "--batch", "4", *corpus_args]) == 0  # fmt: skip
    init = load_drafter(packed / "drafter", load_target(packed / "target"))
    out = tmp_path / "tuned"
    argv = ["train", "drafter", "--target", str(packed / "target"), "--out", str(out),
            "--init", str(packed / "drafter"), "--regen-data", str(regen), "--steps", "8",
            "--short-data", str(short), "--short-every", "2", "--short-batch", "3",
            "--batch", "4", "--seq-len", "64", "--rows-per-seq", "64", "--lr", "1e-9",
            "--warmup", "1", "--log-every", "1", "--eval-every", "3", "--distill", "0.5",
            "--hard-labels", "target", "--select", "tau", "--dtype", "float32",
            "--target-dtype", "float32", *corpus_args]  # fmt: skip
    bad = [a if a != "2" or argv[i - 1] != "--short-every" else "0" for i, a in enumerate(argv)]
    with pytest.raises(SystemExit, match="--short-every must be 1 or more"):
        main(bad)
    assert main(argv) == 0
    log = json.loads((out / "train_log.json").read_text())
    assert {"regen_tau_b8", "holdout_tau_b16", "short_tau_b8", "short_tau_b16"} <= set(
        log["eval"][0]
    )
    assert log["summary"]["init"] == str(packed / "drafter")
    # every second step trains on the short rows; each kind of step alternates the block sizes
    kinds = [(r["short"], r["block"]) for r in log["train"]]
    assert kinds == [(0, 8), (1, 8), (0, 16), (1, 16)] * 2
    assert log["summary"]["short_every"] == 2 and log["summary"]["short_sequences"] == 5
    png = tmp_path / "loss.png"  # the plot draws the short steps' losses as a curve of their own
    capsys.readouterr()
    assert main(["train", "plot", f"tuned={out}", "--out", str(png)]) == 0
    panels = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["panels"]
    assert panels["tuned"][:2] == ["train", "train, short steps"] and png.stat().st_size > 0
    tuned = load_drafter(out, load_target(packed / "target"))
    assert tuned.cfg == init.cfg
    assert "quantization" not in json.loads((out / "config.json").read_text())
    # lr 1e-9: the tuned weights are the init's (dequantized) weights
    assert mx.allclose(tuned.body.fc.weight, init.body.fc.weight, atol=1e-5).item()
    # a batch of regenerated rows only (no corpus windows) trains too
    only = list(argv)
    for flag in ("--short-data", "--short-every", "--short-batch"):
        i = only.index(flag)
        del only[i : i + 2]
    only[only.index("--steps") + 1] = "1"
    only[only.index(str(out))] = str(tmp_path / "regen-only")
    assert main([*only, "--regen-frac", "1"]) == 0


def test_dflash_drafter_upgrades_to_dflash2(tmp_path, tiny_pair, corpus_args):
    """`train drafter --init <DFlash> --kind dflash2` keeps the DFlash drafter's layers in a new
    DFlash 2 drafter (new convolutions and selector), which loads and drafts losslessly."""
    from sanctum.engine.decode.generate import generate

    target_dir, drafter_dir = tiny_pair
    out = tmp_path / "up"
    argv = ["train", "drafter", "--target", str(target_dir), "--out", str(out), "--init",
            str(drafter_dir), "--kind", "dflash2", "--selector-rank", "16", "--steps", "2",
            "--batch", "2", "--seq-len", "64", "--rows-per-seq", "64", "--lr", "1e-9",
            "--warmup", "1", "--log-every", "1", "--eval-every", "0", "--dtype", "float32",
            *corpus_args]  # fmt: skip
    assert main(argv) == 0
    target = load_target(target_dir)
    v1, v2 = load_drafter(drafter_dir, target), load_drafter(out, target)
    assert not v1.cfg.is_v2 and v2.cfg.is_v2 and v2.block_size == v1.block_size
    assert mx.allclose(v2.body.fc.weight, v1.body.fc.weight, atol=1e-6).item()
    prompt = list(range(20, 60))
    plain = [t for s in generate(target, prompt, max_tokens=16, eos_ids=set()) for t in s.tokens]
    spec = generate(target, prompt, drafter=v2, max_tokens=16, eos_ids=set())
    assert [t for s in spec for t in s.tokens] == plain


def test_init_with_sliding_window_relayers_the_drafter(tmp_path, tiny_pair, corpus_args):
    """`train drafter --init D --sliding-window W` keeps D's weights under the new attention
    rule: every layer of the checkpoint slides; over a context inside both D's window and W its
    block hidden states are D's, over a longer one they differ (the window took effect)."""
    target_dir, drafter_dir = tiny_pair
    out = tmp_path / "sw"
    argv = ["train", "drafter", "--target", str(target_dir), "--out", str(out), "--init",
            str(drafter_dir), "--sliding-window", "32", "--steps", "1",
            "--batch", "2", "--seq-len", "64", "--rows-per-seq", "64", "--lr", "1e-12",
            "--warmup", "1", "--log-every", "1", "--eval-every", "0", "--dtype", "float32",
            *corpus_args]  # fmt: skip
    assert main(argv) == 0
    target = load_target(target_dir)
    base, slid = load_drafter(drafter_dir, target), load_drafter(out, target)
    assert set(slid.cfg.layer_types) == {"sliding_attention"} and slid.cfg.sliding_window == 32
    assert slid.cfg.is_causal == base.cfg.is_causal
    assert mx.allclose(slid.body.fc.weight, base.body.fc.weight, atol=1e-6).item()
    L = base.block_size
    embeds = target.embed_tokens(mx.array([7] + [base.cfg.mask_token_id] * (L - 1)))[None]
    width = len(base.cfg.target_layer_ids) * base.cfg.hidden_size

    def block_hidden(drafter, ctx):
        taps = mx.random.normal((1, ctx, width), key=mx.random.key(ctx))
        return drafter.body(embeds, ctx, taps, drafter.body.make_cache())

    assert mx.allclose(block_hidden(slid, 6), block_hidden(base, 6), atol=1e-5).item()
    assert not mx.allclose(block_hidden(slid, 100), block_hidden(base, 100), atol=1e-3).item()
