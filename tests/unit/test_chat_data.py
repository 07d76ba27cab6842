"""data.format chat and instruction (kubetrain.trainer.data.chat): what the loss counts, shown by decoding the
counted targets, with the byte tokenizer and with a Hugging Face tokenizer and chat template built here; the
cut and the padding; the order as a pure function of (seed, step) that covers every sample once an epoch; the
held-out samples; errors naming the field and the line; data.uri fetched into the cache."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from support.hf_models import bpe_tokenizer, chat_tokenizer
from support.paths import EXAMPLE_DATA

from kubetrain.core import contract
from kubetrain.core.api import TrainingJobSpec
from kubetrain.trainer.config import ConfigError
from kubetrain.trainer.data import chat
from kubetrain.trainer.data.fetch import MARKER, resolved
from kubetrain.trainer.loop import check_vocab

CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "It is 4."},
    {"role": "user", "content": "And 3+3?"},
    {"role": "assistant", "content": "Six."},
]


def write_jsonl(path: Path, objects: list[Any]) -> Path:
    path.write_text("".join(json.dumps(o) + "\n" for o in objects))
    return path


def job(path: Path, fmt: str = "chat", seq_len: int = 128, **spec: Any) -> TrainingJobSpec:
    data = {"path": str(path), "format": fmt, **spec.pop("data", {})}
    return TrainingJobSpec.model_validate({"model": {"seqLen": seq_len}, "data": data, "seed": 5, **spec})


def samples_of(tmp_path: Path, objects: list[Any], fmt: str = "chat", seq_len: int = 128,
               **data: Any) -> chat.ChatSampler:
    return chat.open_samples(job(write_jsonl(tmp_path / "d.jsonl", objects), fmt, seq_len, data=data))[0]


def counted_text(tokens: torch.Tensor, targets: torch.Tensor, decode: Any) -> tuple[str, str]:
    """(the sample's text, the text of its counted targets) of one row."""
    real = tokens[tokens != chat.PAD_ID] if decode is byte_decode else tokens
    return decode(real.tolist()), decode(targets[targets != chat.IGNORE_INDEX].tolist())


def byte_decode(ids: list[int]) -> str:
    return bytes(ids).decode("utf-8")


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A byte-level BPE tokenizer with ChatML's markers, its chat template and EOS in tokenizer_config.json."""
    out = tmp_path_factory.mktemp("chat-tokenizer")
    chat_tokenizer(out, [EXAMPLE_DATA / "licenses.txt"])
    return out


def hf_decode(directory: Path) -> Any:
    tokenizer = chat.TokenizerCodec(str(directory)).tokenizer
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=False)


# --------------------------------------------------------------------------- what is counted


def test_byte_chat_counts_the_assistant_turns_and_their_end_only(tmp_path: Path) -> None:
    x, y = samples_of(tmp_path, [{"messages": CONVERSATION}], seq_len=256).micro_batches(0, 1, 1, 1, 0)[0]
    text, counted = counted_text(x[0], y[0], byte_decode)
    assert text == ("<|system|>\nBe brief.<|end|>\n<|user|>\nWhat is 2+2?<|end|>\n<|assistant|>\nIt is 4.<|end|>\n"
                    "<|user|>\nAnd 3+3?<|end|>\n<|assistant|>\nSix.<|end|>\n")
    assert counted == "It is 4.<|end|>\nSix.<|end|>\n"
    assert x.shape == y.shape == (1, 256) and x.dtype == y.dtype == torch.int64


def test_a_chat_template_of_the_tokenizer_decides_what_is_counted(tmp_path: Path, hf_dir: Path) -> None:
    x, y = samples_of(tmp_path, [{"messages": CONVERSATION}], tokenizer=str(hf_dir)).micro_batches(0, 1, 1, 1, 0)[0]
    n = int((y[0] != chat.IGNORE_INDEX).nonzero().max()) + 1  # the sample's length: padding after it
    text, counted = counted_text(x[0, :n], y[0], hf_decode(hf_dir))
    assert text.startswith("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n")
    assert counted == "It is 4.<|im_end|>\nSix.<|im_end|>\n"
    im_end = chat.TokenizerCodec(str(hf_dir)).token_id("<|im_end|>")
    assert im_end is not None and int((y[0] == im_end).sum()) == 2  # the turns' end markers are single tokens


def test_a_template_that_renders_earlier_turns_differently_still_finds_them() -> None:
    def render(messages: list[dict[str, Any]], add_generation_prompt: bool) -> str:
        # Like templates that drop reasoning from earlier turns: only the last assistant turn gets a think block.
        last = max(i for i, m in enumerate(messages) if m["role"] == "assistant") if not add_generation_prompt \
            and any(m["role"] == "assistant" for m in messages) else -1
        text = "".join(f"[{m['role']}]{'<think></think>' if i == last else ''}{m['content']}</s>"
                       for i, m in enumerate(messages))
        return text + ("[assistant]" if add_generation_prompt else "")

    found = chat.assistant_spans(CONVERSATION, render)
    assert found is not None
    full, spans = found
    assert [full[a:b] for a, b in spans] == ["It is 4.</s>", "<think></think>Six.</s>"]


def test_instruction_counts_the_response_and_an_end_marker(tmp_path: Path, hf_dir: Path) -> None:
    line = {"prompt": "Q: 2+2?\nA: ", "response": "4"}
    x, y = samples_of(tmp_path, [line], "instruction").micro_batches(0, 1, 1, 1, 0)[0]
    assert counted_text(x[0], y[0], byte_decode) == ("Q: 2+2?\nA: 4<|end|>", "4<|end|>")
    x, y = samples_of(tmp_path, [line], "instruction", tokenizer=str(hf_dir)).micro_batches(0, 1, 1, 1, 0)[0]
    counted = y[0][y[0] != chat.IGNORE_INDEX].tolist()
    assert hf_decode(hf_dir)(counted) == "4<|im_end|>" and counted[-1] == chat.TokenizerCodec(
        str(hf_dir)).token_id("<|im_end|>")  # the tokenizer's EOS, one token


def test_instruction_without_an_eos_ends_with_the_byte_templates_marker(tmp_path: Path) -> None:
    bpe_tokenizer(tmp_path / "tok", [EXAMPLE_DATA / "licenses.txt"])  # tokenizer.json only
    line = {"prompt": "Q: 2+2?\nA: ", "response": "4"}
    x, y = samples_of(tmp_path, [line], "instruction", tokenizer=str(tmp_path / "tok")).micro_batches(0, 1, 1, 1, 0)[0]
    assert hf_decode(tmp_path / "tok")(y[0][y[0] != chat.IGNORE_INDEX].tolist()) == "4<|end|>"


# --------------------------------------------------------------------------- cut and padding


def test_samples_are_cut_at_seq_len_plus_one_and_padded(tmp_path: Path) -> None:
    short = {"prompt": "ab", "response": "cd"}
    long = {"prompt": "p" * 5, "response": "r" * 50}
    x, y = samples_of(tmp_path, [short, long], "instruction", seq_len=16).samples.rows([0, 1])
    ids = list(b"abcd<|end|>")
    assert x[0].tolist() == ids + [chat.PAD_ID] * (16 - len(ids))  # its last token's target is padding
    assert y[0].tolist() == [chat.IGNORE_INDEX] + ids[2:] + [chat.IGNORE_INDEX] * (16 - len(ids) + 1)
    assert x[1].tolist() == list(b"p" * 5 + b"r" * 11) and y[1].tolist() == [chat.IGNORE_INDEX] * 4 + list(b"r" * 12)


def test_a_sample_without_a_counted_target_after_the_cut_is_left_out(tmp_path: Path,
                                                                     caplog: pytest.LogCaptureFixture) -> None:
    kept, lost = {"prompt": "a", "response": "b"}, {"prompt": "p" * 40, "response": "r"}
    with caplog.at_level("INFO", logger="kubetrain.trainer.data.chat"):
        assert len(samples_of(tmp_path, [kept, lost], "instruction", seq_len=16).samples) == 1
    assert "1 left out" in caplog.text
    with pytest.raises(ConfigError) as err:
        samples_of(tmp_path, [lost], "instruction", seq_len=16)
    assert err.value.field == "data.path" and "seqLen+1 = 17" in err.value.message


# --------------------------------------------------------------------------- order


def numbered(n: int) -> list[dict[str, Any]]:
    return [{"prompt": f"{i:02d}", "response": "x"} for i in range(n)]


def sample_numbers(sampler: chat.ChatSampler, step: int, world_size: int, rank: int) -> list[int]:
    return [int(bytes(row[:2].tolist())) for x, _ in sampler.micro_batches(step, 1, 2, world_size, rank) for row in x]


def test_the_order_is_a_pure_function_of_seed_and_step(tmp_path: Path) -> None:
    a = samples_of(tmp_path, numbered(10), "instruction", seq_len=8)
    b = samples_of(tmp_path, numbered(10), "instruction", seq_len=8)
    assert sample_numbers(a, 7, 2, 1) == sample_numbers(b, 7, 2, 1)
    b.micro_batches(3, 1, 2, 2, 0)  # another step first: no state carries over
    assert [sample_numbers(b, s, 2, r) for s in range(8) for r in range(2)] == \
        [sample_numbers(a, s, 2, r) for s in range(8) for r in range(2)]
    other = chat.ChatSampler(a.samples, seed=6)
    assert [sample_numbers(other, s, 2, 0) for s in range(3)] != [sample_numbers(a, s, 2, 0) for s in range(3)]
    # the ranks' contiguous chunks make the global batch one rank with all of it would take
    assert sample_numbers(a, 4, 2, 0) + sample_numbers(a, 4, 2, 1) == \
        [int(bytes(r[:2].tolist())) for r in a.micro_batches(4, 4, 1, 1, 0)[0][0]]


def test_every_sample_is_seen_once_an_epoch(tmp_path: Path) -> None:
    sampler = samples_of(tmp_path, numbered(12), "instruction", seq_len=8)
    seen = [n for s in range(6) for r in range(2) for n in sample_numbers(sampler, s, 2, r)]  # 2 epochs of 12
    assert sorted(seen[:12]) == sorted(seen[12:]) == list(range(12))
    assert seen[:12] != seen[12:] and seen[:12] != list(range(12))  # shuffled, anew each epoch


# --------------------------------------------------------------------------- evaluation


def test_the_last_samples_are_held_out_for_evaluation(tmp_path: Path) -> None:
    spec = job(write_jsonl(tmp_path / "d.jsonl", numbered(40)), "instruction", 8, evalEverySteps=5, evalBatches=2)
    train, held = chat.open_samples(spec)
    assert held is not None and len(held) == 2 and len(train.samples) == 38
    trained = {n for s in range(19) for n in sample_numbers(train, s, 1, 0)}
    assert trained == set(range(38))
    first, again = chat.eval_batches(held, spec, 2, 1), chat.eval_batches(held, spec, 2, 1)
    assert len(first) == 2 and all(torch.equal(a[0], b[0]) for a, b in zip(first, again, strict=True))  # fixed
    assert {int(bytes(r[:2].tolist())) for x, _ in first for r in x} <= {38, 39}
    spec = job(tmp_path / "d.jsonl", "instruction", 8, evalEverySteps=5,
               data={"evalPath": str(write_jsonl(tmp_path / "e.jsonl", numbered(3)))})
    train, held = chat.open_samples(spec)
    assert held is not None and len(held) == 3 and len(train.samples) == 40


def test_chat_ids_must_fit_the_models_vocabulary(tmp_path: Path, hf_dir: Path) -> None:
    sampler = samples_of(tmp_path, [{"messages": CONVERSATION}], tokenizer=str(hf_dir))
    check_vocab(sampler, sampler.samples, 302)
    with pytest.raises(ConfigError) as err:
        check_vocab(sampler, None, 256)  # the ChatML markers are ids 300 and 301
    assert err.value.field == "data.tokenizer" and "301" in err.value.message


# --------------------------------------------------------------------------- errors


@pytest.mark.parametrize(("line", "reason"), [
    ("{not json", "not valid JSON"),
    ('["a list"]', "not a JSON object"),
    ('{"text": "hi"}', 'no "messages"'),
    ('{"messages": [{"role": "user"}]}', 'message 0 needs a "role" and a string "content"'),
    ('{"messages": [{"role": "robot", "content": "x"}]}', "the role 'robot'"),
    ('{"messages": [{"role": "user", "content": "x"}]}', "no assistant message"),
])
def test_a_bad_chat_line_names_the_field_file_and_line(tmp_path: Path, line: str, reason: str) -> None:
    good = json.dumps({"messages": CONVERSATION})
    path = tmp_path / "d.jsonl"
    path.write_text(f"{good}\n\n{line}\n")  # blank lines are skipped but counted
    with pytest.raises(ConfigError) as err:
        chat.open_samples(job(path))
    assert err.value.field == "data.path" and f"{path}:3: " in err.value.message and reason in err.value.message


def test_bad_instruction_and_eval_lines_name_their_field(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as err:
        samples_of(tmp_path, [{"prompt": "p"}], "instruction")
    assert err.value.field == "data.path" and 'string "response"' in err.value.message
    write_jsonl(tmp_path / "d.jsonl", numbered(3))
    bad = tmp_path / "e.jsonl"
    bad.write_text("{}\n")
    with pytest.raises(ConfigError) as err:
        chat.open_samples(job(tmp_path / "d.jsonl", "instruction", evalEverySteps=2, data={"evalPath": str(bad)}))
    assert err.value.field == "data.evalPath" and f"{bad}:1: " in err.value.message


def test_a_tokenizer_without_a_chat_template_is_refused(tmp_path: Path) -> None:
    bpe_tokenizer(tmp_path / "tok", [EXAMPLE_DATA / "licenses.txt"])
    with pytest.raises(ConfigError) as err:
        samples_of(tmp_path, [{"messages": CONVERSATION}], tokenizer=str(tmp_path / "tok"))
    assert err.value.field == "data.tokenizer" and "no chat template" in err.value.message


def test_a_directory_reads_its_sorted_jsonl_files_not_hidden_ones(tmp_path: Path) -> None:
    write_jsonl(tmp_path / "b.jsonl", numbered(12)[6:])
    write_jsonl(tmp_path / "a.jsonl", numbered(12)[:6])
    (tmp_path / MARKER).write_text("{}")  # the fetch step's marker: *.json* would match it
    (tmp_path / "notes.txt").write_text("not a sample")
    spec = job(tmp_path, "instruction", 8, data={"glob": "*.json*"})
    assert [int(bytes(r[:2].tolist())) for r in chat.open_samples(spec)[0].samples.rows(list(range(12)))[0]] == \
        list(range(12))


# --------------------------------------------------------------------------- data.uri


def test_chat_data_uri_is_fetched_and_read_from_the_cache(tmp_path: Path) -> None:
    uri = "s3://bucket/chats"
    spec = TrainingJobSpec.model_validate({"data": {"uri": uri, "format": "chat", "glob": "*.jsonl"}})
    assert spec.fetched_uris() == {"data.uri": uri}
    text = TrainingJobSpec.model_validate({"data": {"uri": uri}})
    assert text.fetched_uris() == {} and resolved(text, None) == text  # text shards stream instead
    with pytest.raises(ConfigError) as err:
        resolved(spec, tmp_path)
    assert err.value.field == "data.uri"
    (tmp_path / contract.SAMPLES_CACHE).mkdir()
    (tmp_path / contract.SAMPLES_CACHE / MARKER).write_text(json.dumps({"uri": uri, "objects": {}}))
    data = resolved(spec, tmp_path).data
    assert data.uri is None and data.path == str(tmp_path / contract.SAMPLES_CACHE) and data.format == "chat"
