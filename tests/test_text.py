"""The text side: streamed deltas add up to the decoded completion; stop sequences cut it."""

from __future__ import annotations

import pytest
from sanctum.engine.target import load_target
from sanctum.tokenizer import TextStream, message_starts, render_chat


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
    starts = message_starts(tokenizer, msgs)
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert starts[-1] == len(ids) and starts == sorted(starts)
    first_turn = tokenizer.encode(render_chat(tokenizer, msgs[:1]), add_special_tokens=False)
    assert ids[: len(first_turn)] == first_turn  # turn 2 shares turn 1's prompt exactly
