"""The text side: streamed deltas add up to the decoded completion; stop sequences cut it."""

from __future__ import annotations

import random

import pytest
from mlx_lm.utils import load_tokenizer
from sanctum.engine.model.target import load_target
from sanctum.settings import default_pair
from sanctum.tokenizer import Reencoder, TextStream, message_starts, render_chat


@pytest.fixture(scope="module")
def tokenizer(make_pair):
    return load_target(make_pair("hybrid", "dflash")[0]).tokenizer


@pytest.mark.parametrize(
    "text", ["def f(x):\n    return x  # ünïcode ✓ 漢字\n", "a" * 50 + "🙂 end"]
)
def test_stream_deltas_reassemble_decoded_text(tokenizer, text):
    ids = tokenizer.encode(text, add_special_tokens=False)
    for step in (1, 3, 8):
        stream = TextStream(tokenizer)
        out = "".join(stream.push(ids[i : i + step]) for i in range(0, len(ids), step))
        out += stream.finish()
        assert out == tokenizer.decode(ids) == text


def test_stop_sequence_is_held_back_then_cut(tokenizer):
    text = "alpha beta STOP gamma"
    ids = tokenizer.encode(text, add_special_tokens=False)
    stream = TextStream(tokenizer, ["STOP"])
    emitted, kept = "", []
    for t in ids:
        n, stop = stream.check(kept, [t])
        kept.append(t)
        emitted += stream.push([t])
        assert "STO" not in emitted  # a possible stop prefix is never emitted early
        if stop:
            break
    emitted += stream.finish()
    assert emitted == "alpha beta "


def test_chat_template_drops_earlier_think_and_marks_message_starts(tokenizer):
    msgs = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "<think>\nsecret\n</think>\n\nhello"},
        {"role": "user", "content": "again"},
    ]
    text = render_chat(tokenizer, msgs)
    assert "secret" not in text and text.endswith("<|im_start|>assistant\n")
    ids = tokenizer.encode(text, add_special_tokens=False)
    starts = message_starts(tokenizer, msgs, ids)
    assert starts[-1] == len(ids) and starts == sorted(starts)
    first_turn = tokenizer.encode(render_chat(tokenizer, msgs[:1]), add_special_tokens=False)
    assert ids[: len(first_turn)] == first_turn  # turn 2 shares turn 1's prompt exactly


def _starts_by_rendering_every_prefix(tok, msgs):
    """The definition (and the old, quadratic way): encode each prefix's rendering."""
    starts = [
        len(tok.encode(render_chat(tok, msgs[:i], add_generation_prompt=False),
                       add_special_tokens=False))
        for i in range(1, len(msgs) + 1)
    ]  # fmt: skip
    return [*starts, len(tok.encode(render_chat(tok, msgs), add_special_tokens=False))]


def test_message_starts_are_the_prefix_encodings_found_in_one_pass(tokenizer):
    """The starts equal each prefix's own encoding length (random chats, think blocks, spaces
    and newlines at the edges), and 800 messages take one render and one encode, not 800
    (rendering each prefix would be quadratic, and stall every other stream)."""
    import time

    rng = random.Random(0)
    pieces = ["hi", " there", "\n", "  x = 1\n", "<think>\nhm\n</think>\n\nok", "é 漢", ""]
    for _ in range(20):
        msgs = [{"role": rng.choice(["system", "user", "assistant"]),
                 "content": "".join(rng.choices(pieces, k=rng.randint(0, 4)))}
                for _ in range(rng.randint(1, 6))]  # fmt: skip
        ids = tokenizer.encode(render_chat(tokenizer, msgs), add_special_tokens=False)
        assert message_starts(tokenizer, msgs, ids) == _starts_by_rendering_every_prefix(
            tokenizer, msgs
        )
    chat = [{"role": ("user", "assistant")[i % 2], "content": f"message {i} " + "w" * 30}
            for i in range(800)]  # fmt: skip
    t0 = time.perf_counter()
    ids = tokenizer.encode(render_chat(tokenizer, chat), add_special_tokens=False)
    starts = message_starts(tokenizer, chat, ids)
    assert time.perf_counter() - t0 < 2.0
    assert len(starts) == 801 and starts == sorted(starts) and starts[-1] == len(ids)


REENCODE_TEXT = (
    'def mean(xs):\n    """Average; ünïcode ✓ 漢字 🙂."""\n\n\n    return sum(xs)  /  len(xs)\n'
    "It's    spaced\t\ttabs, 'quotes', 1234567 and    \n\n  trailing   \n"
)


def _first_difference_by_full_reencoding(tok, ids, final):
    while not final and tok.decode(ids).endswith("\ufffd"):
        ids = ids[:-1]  # a character's first bytes: wait for the rest
    canonical = tok.encode(tok.decode(ids), add_special_tokens=False)
    stable = min(len(ids), len(canonical)) - (0 if final else 2)
    return next((j for j in range(stable) if ids[j] != canonical[j]), None)


def _split_some_tokens(tok, ids, rng, count):
    """The same text in tokens the encoder would not choose: some tokens replaced by the
    encodings of two halves of their text (as a model may emit "\n   " as "\n" + "   ")."""
    ids = list(ids)
    for j in rng.sample(range(len(ids)), len(ids)):
        piece = tok.decode([ids[j]])
        if count == 0:
            break
        if len(piece) < 2 or "\ufffd" in piece:
            continue
        cut = rng.randrange(1, len(piece))
        parts = [tok.encode(x, add_special_tokens=False) for x in (piece[:cut], piece[cut:])]
        ids[j : j + 1] = parts[0] + parts[1]
        count -= 1
    return ids


@pytest.fixture(scope="module", params=["tiny", "default"])
def any_tokenizer(request, tokenizer):
    """The project's tiny byte-level BPE, and the default model's Qwen3.5 tokenizer (regex split,
    NFC), both through mlx-lm's loader."""
    return tokenizer if request.param == "tiny" else load_tokenizer(default_pair()[0])


@pytest.mark.parametrize("splits", [0, 1, 3])
def test_windowed_reencoding_finds_what_full_reencoding_finds(any_tokenizer, splits):
    """Round by round (1 to 9 tokens, as speculative rounds commit), the windowed re-encoder
    reports the same first difference as re-encoding the whole sequence, at every round, and it
    keeps its window short: the text before the last settled boundary is never encoded again."""
    tok = any_tokenizer
    rng = random.Random(splits)
    for trial in range(6):
        text = REENCODE_TEXT * 12 + "<|im_end|>" * (trial % 2)
        ids = _split_some_tokens(tok, tok.encode(text, add_special_tokens=False), rng, splits)
        reencoder, end, found = Reencoder(tok), 0, None
        while end < len(ids) and found is None:
            end = min(len(ids), end + rng.randint(1, 9))
            final = end == len(ids)
            found = reencoder.first_difference(ids[:end], final)
            assert found == _first_difference_by_full_reencoding(tok, ids[:end], final), end
            if found is None:
                assert end - reencoder.settled < 64, (end, reencoder.settled)
        assert (found is None) == (splits == 0)


def test_reencoding_without_a_fast_backend_reencodes_everything_then_gives_up(tokenizer):
    """A tokenizer with only encode and decode: the whole sequence each call, same answers; and
    past MAX_WINDOW tokens the re-encoder gives up instead of slowing every round."""

    class Plain:
        def encode(self, text, add_special_tokens=False):
            return tokenizer.encode(text, add_special_tokens=add_special_tokens)

        def decode(self, ids):
            return tokenizer.decode(ids)

    canonical = tokenizer.encode(REENCODE_TEXT * 4, add_special_tokens=False)
    ids = _split_some_tokens(tokenizer, canonical, random.Random(7), 1)
    reencoder, found = Reencoder(Plain()), None
    reencoder.MAX_WINDOW = len(ids)
    for end in range(5, len(ids) + 5, 5):
        found = reencoder.first_difference(ids[:end], final=end >= len(ids))
        assert found == _first_difference_by_full_reencoding(tokenizer, ids[:end], end >= len(ids))
        assert reencoder.settled == 0 and not reencoder.exhausted
        if found is not None:
            break
    assert found is not None
    short = Reencoder(Plain())
    short.MAX_WINDOW = 20
    assert short.first_difference(canonical[:20], final=False) is None and not short.exhausted
    assert short.first_difference(canonical[:21], final=False) is None and short.exhausted


def test_reencode_bench_prints_its_figures(make_pair):
    """`sanctum bench reencode` runs (on the tiny tokenizer) and reports what the note quotes."""
    from argparse import Namespace

    from sanctum.bench.multiturn import reencode

    figures = reencode(Namespace(model=str(make_pair("hybrid", "dflash")[0]), round_tokens=6,
                                 lengths="64,256"))  # fmt: skip
    assert figures["gave_up"] is False and 0 < figures["widest_window_tokens"] < 64
    assert {"windowed_ms_at_64", "whole_ms_at_64", "windowed_ms_at_256", "whole_ms_at_256"} <= set(
        figures
    )
