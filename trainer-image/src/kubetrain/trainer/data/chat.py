"""Fine-tuning data (data.format `chat` or `instruction`): JSONL samples as masked, padded token sequences, and
their resumable order.

Each non-blank line of the JSONL files is one sample, tokenised once at start:
- chat: ``{"messages": [{"role": ..., "content": ...}, ...]}``, rendered with the tokenizer directory's own chat
  template (transformers' ``apply_chat_template``), or :func:`byte_template` with the byte tokenizer. The
  characters that are the assistant's are found by rendering incrementally: a turn runs from the end of the
  conversation before it rendered with the generation prompt to the end of the conversation through it, so
  the template's end-of-turn marker after the content is counted too (the model learns to stop).
- instruction: ``{"prompt": ..., "response": ...}``: the prompt's tokens (with the special tokens the tokenizer
  adds to one sequence, e.g. a BOS), then the response's, then an end marker: the tokenizer's EOS token, else
  :data:`END` as text. Only the response and the end marker are counted.

A token is counted when any of its characters is in a counted span. Each sample is cut at seqLen+1 tokens and
padded to it with :data:`PAD_ID` (never packed: with causal attention and right padding no real token sees
a pad or another sample); its targets are the next tokens where counted, else :data:`IGNORE_INDEX`, which
every loss path (model.lm_loss: F.cross_entropy's default ignore_index) leaves out.

The order (:class:`ChatSampler`): every sample once an epoch, in a permutation drawn from (seed, epoch); the
global batch of step s is samples [s·G, (s+1)·G) of that endless sequence, split over the data-parallel ranks
and micro-batches as text.Sampler splits its windows. So the batch of step s is a pure function of (seed, s)
and a resumed run sees exactly what the uninterrupted one saw.
"""

from __future__ import annotations

import importlib.util
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from kubetrain.core.api import DataSpec, TrainingJobSpec
from kubetrain.trainer.config import ConfigError
from kubetrain.trainer.data.text import HELD_OUT_FRACTION, data_files, hf_tokenizer, step_seed

log = logging.getLogger("kubetrain.trainer.data.chat")

IGNORE_INDEX = -100
"""The target of a token the loss does not count: F.cross_entropy's default ignore_index."""
PAD_ID = 0
"""The token id that pads a sample to seqLen+1 (never counted, never attended to by a real token)."""
END = "<|end|>"
"""The byte template's end of a turn, and the instruction format's end marker without a tokenizer EOS."""
BYTE_ROLES = ("system", "user", "assistant")
TEMPLATE_ROLES = (*BYTE_ROLES, "tool")
"""A Hugging Face chat template may render tool results too (it refuses them, with its own message, if not)."""
TEMPLATE_FILE = "chat_template.jinja"
TOKENIZER_CONFIG = "tokenizer_config.json"
TEMPLATE_DATE = "26 Jul 2024"
"""What a chat template that prints the date (Llama 3.x's `date_string`) is given: one fixed day, so that samples
do not depend on the day they are rendered (the date Llama 3.1's own template falls back to)."""

Render = Callable[[list[dict[str, Any]], bool], str]
"""A chat template: (messages, add_generation_prompt) -> text."""


class Codec(Protocol):
    """Text to token ids, with each token's character span in the text."""

    def encode(self, text: str, special: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """(ids int64 [n], offsets int64 [n, 2]: each token's [start, end) in characters); ``special``: add the
        special tokens the tokenizer puts around one sequence (a BOS)."""
        ...


class ByteCodec:
    """UTF-8 bytes: every byte of a character has that character's span."""

    def encode(self, text: str, special: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        data = torch.frombuffer(bytearray(text.encode("utf-8")), dtype=torch.uint8) if text else torch.zeros(
            0, dtype=torch.uint8)
        char = ((data & 0xC0) != 0x80).long().cumsum(0) - 1  # continuation bytes belong to the character before
        return data.long(), torch.stack([char, char + 1], dim=1)


class TokenizerCodec:
    """A Hugging Face tokenizer.json (the `tokenizers` package), as data.format text reads it."""

    def __init__(self, directory: str) -> None:
        self.tokenizer = hf_tokenizer(directory)

    def encode(self, text: str, special: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        enc = self.tokenizer.encode(text, add_special_tokens=special)
        return torch.tensor(enc.ids, dtype=torch.long), torch.tensor(enc.offsets, dtype=torch.long).reshape(-1, 2)

    def token_id(self, token: str) -> int | None:
        found = self.tokenizer.token_to_id(token)
        return None if found is None else int(found)


def byte_template(messages: list[dict[str, Any]], add_generation_prompt: bool) -> str:
    """The byte tokenizer's chat template: each message ``<|role|>\\n{content}<|end|>\\n``, then
    ``<|assistant|>\\n`` as the generation prompt."""
    text = "".join(f"<|{m['role']}|>\n{m['content']}{END}\n" for m in messages)
    return text + ("<|assistant|>\n" if add_generation_prompt else "")


# --------------------------------------------------------------------------- reading


@dataclass(frozen=True)
class Line:
    where: str
    """`file:line`, for errors."""
    obj: dict[str, Any]


def jsonl_files(data: DataSpec, field: str) -> list[Path]:
    """data.path's files (data.glob in a directory, sorted), without hidden ones: the fetch step's marker and
    partial downloads."""
    files = [p for p in data_files(data, field) if not p.name.startswith(".")]
    if not files:
        raise ConfigError("data.glob", f"no files match {data.glob!r} under {data.path}")
    return files


def read_lines(data: DataSpec, field: str) -> list[Line]:
    """One JSON object per non-blank line, in file order."""
    lines = []
    for path in jsonl_files(data, field):
        try:
            text = path.read_bytes().decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ConfigError(field, f"{path}: not UTF-8 ({exc})") from None
        for n, raw in enumerate(text.split("\n"), 1):  # not splitlines: U+2028 may sit inside a JSON string
            if raw.strip():
                lines.append(Line(f"{path}:{n}", parse_object(raw, f"{path}:{n}", field)))
    return lines


def parse_object(raw: str, where: str, field: str) -> dict[str, Any]:
    try:
        obj = json.loads(raw)
    except ValueError as exc:
        raise ConfigError(field, f"{where}: not valid JSON ({exc})") from None
    if not isinstance(obj, dict):
        raise ConfigError(field, f"{where}: not a JSON object")
    return obj


def messages_of(line: Line, field: str, roles: tuple[str, ...]) -> list[dict[str, Any]]:
    """The conversation of a chat line, checked: a message list with an assistant turn, each message a known
    role and a string content."""
    messages = line.obj.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ConfigError(field, f'{line.where}: no "messages" (a non-empty list of {{"role", "content"}})')
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise ConfigError(field, f'{line.where}: message {i} needs a "role" and a string "content"')
        if m["role"] not in roles:
            raise ConfigError(field, f"{line.where}: message {i} has the role {m['role']!r}, not one of "
                                     f"{', '.join(roles)}")
    if not any(m["role"] == "assistant" for m in messages):
        raise ConfigError(field, f"{line.where}: no assistant message (nothing to learn)")
    return messages


def prompt_response(line: Line, field: str) -> tuple[str, str]:
    prompt, response = line.obj.get("prompt"), line.obj.get("response")
    if not isinstance(prompt, str) or not isinstance(response, str):
        raise ConfigError(field, f'{line.where}: needs a string "prompt" and a string "response"')
    return prompt, response


# --------------------------------------------------------------------------- what is counted


def assistant_spans(messages: list[dict[str, Any]], render: Render) -> tuple[str, list[tuple[int, int]]] | None:
    """The rendered conversation and each assistant turn's character span in it (None: a turn not found)."""
    full = render(messages, False)
    spans: list[tuple[int, int]] = []
    cursor = 0
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        span = turn_span(full, render(messages[:i], True), render(messages[: i + 1], False), m["content"], cursor)
        if span is None:
            return None
        spans.append(span)
        cursor = span[1]
    return full, spans


def turn_span(full: str, before: str, through: str, content: str, cursor: int) -> tuple[int, int] | None:
    """One assistant turn's [start, end) in ``full``: from the end of ``before`` (the conversation before it with
    the generation prompt) to the end of ``through`` (the conversation up to and with it)."""
    if full.startswith(through) and through.startswith(before) and len(before) >= cursor:
        return len(before), len(through)
    # Some templates render a turn differently once later turns follow it (e.g. reasoning dropped from earlier
    # turns): then the content is found in the whole rendering, with what the template puts after it.
    tail = through[through.rfind(content) + len(content):] if content in through else ""
    start = full.find(content + tail, cursor)
    return None if start < 0 else (start, start + len(content) + len(tail))


def counted_tokens(offsets: torch.Tensor, spans: list[tuple[int, int]]) -> torch.Tensor:
    """Whether each token (its character [start, end)) has a character in one of the spans."""
    counted = torch.zeros(offsets.shape[0], dtype=torch.bool)
    for a, b in spans:
        counted |= (offsets[:, 0] < b) & (offsets[:, 1] > a)
    return counted


# --------------------------------------------------------------------------- encoding


def chat_template(directory: str) -> Render:
    """The directory's own chat template, rendered by transformers (the tokenizer's special tokens, such as
    bos_token, are what the template sees)."""
    if importlib.util.find_spec("transformers") is None:
        raise ConfigError("data.tokenizer", "data.format chat needs the `transformers` package to render the "
                                            "tokenizer's chat template; it is not installed in this image")
    from transformers import AutoTokenizer  # noqa: PLC0415 - optional dependency, slow to import

    try:
        tokenizer = AutoTokenizer.from_pretrained(directory)
    except (OSError, ValueError) as exc:
        raise ConfigError("data.tokenizer", f"{directory}: transformers cannot load the tokenizer ({exc})") from None
    if not getattr(tokenizer, "chat_template", None):
        raise ConfigError("data.tokenizer", f"{directory} has no chat template (`chat_template` in its "
                                            f"{TOKENIZER_CONFIG}, or {TEMPLATE_FILE}): data.format chat renders "
                                            "conversations with it (or use data.format instruction)")

    def render(messages: list[dict[str, Any]], add_generation_prompt: bool) -> str:
        # A fixed date_string: templates that stamp today's date (Llama 3.x's) would otherwise tokenise the same
        # conversation differently on another day, and a resume would not see what the first run saw.
        return str(tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                                 date_string=TEMPLATE_DATE))

    return render


def eos_token(directory: str) -> str | None:
    """The tokenizer's EOS token as its files name it (tokenizer_config.json, else special_tokens_map.json)."""
    for name in (TOKENIZER_CONFIG, "special_tokens_map.json"):
        try:
            found = json.loads((Path(directory) / name).read_text()).get("eos_token")
        except (OSError, ValueError, AttributeError):
            continue
        if isinstance(found, dict):
            found = found.get("content")
        if isinstance(found, str) and found:
            return found
    return None


@dataclass(frozen=True)
class Encoder:
    """One JSONL object as (ids, counted) for the job's format and tokenizer."""

    format: str
    codec: Codec
    render: Render
    roles: tuple[str, ...]
    end: torch.Tensor
    """The instruction format's end marker ids."""

    @classmethod
    def of(cls, data: DataSpec) -> Encoder:
        if data.tokenizer == "byte":
            codec: Codec = ByteCodec()
            return cls(data.format, codec, byte_template, BYTE_ROLES, codec.encode(END)[0])
        hf = TokenizerCodec(data.tokenizer)
        eos = eos_token(data.tokenizer)
        eos_id = hf.token_id(eos) if eos is not None else None
        end = torch.tensor([eos_id]) if eos_id is not None else hf.encode(END)[0]
        render = chat_template(data.tokenizer) if data.format == "chat" else byte_template  # instruction: unused
        return cls(data.format, hf, render, TEMPLATE_ROLES, end)

    def encode(self, line: Line, field: str) -> tuple[torch.Tensor, torch.Tensor]:
        """(ids int64 [n], counted bool [n]) of the whole sample, before the cut."""
        if self.format == "instruction":
            return self.instruction(line, field)
        messages = messages_of(line, field, self.roles)
        try:
            rendered = assistant_spans(messages, self.render)
        except Exception as exc:  # noqa: BLE001 - the template's own refusal (jinja's TemplateError, ...)
            raise ConfigError(field, f"{line.where}: the chat template cannot render it: {exc}") from None
        if rendered is None:
            raise ConfigError("data.tokenizer", f"{line.where}: an assistant turn is not found in the chat "
                                                "template's rendering of the conversation")
        text, spans = rendered
        ids, offsets = self.codec.encode(text)
        return ids, counted_tokens(offsets, spans)

    def instruction(self, line: Line, field: str) -> tuple[torch.Tensor, torch.Tensor]:
        prompt, response = prompt_response(line, field)
        asked = self.codec.encode(prompt, special=True)[0]
        answered = torch.cat([self.codec.encode(response)[0], self.end])
        counted = torch.cat([torch.zeros(asked.numel(), dtype=torch.bool), torch.ones(answered.numel(),
                                                                                     dtype=torch.bool)])
        return torch.cat([asked, answered]), counted


# --------------------------------------------------------------------------- the samples


@dataclass(frozen=True)
class Samples:
    """Every kept sample, cut at seqLen+1 tokens, end to end: ids (int32), whether each is counted, and where
    each sample starts (n+1 offsets). Padding is added per batch, so memory holds real tokens only."""

    ids: torch.Tensor
    counted: torch.Tensor
    starts: torch.Tensor
    seq_len: int

    def __len__(self) -> int:
        return self.starts.numel() - 1

    def max_id(self) -> int:
        return int(self.ids.max()) if self.ids.numel() else 0

    def part(self, first: int, last: int) -> Samples:
        """Samples [first, last)."""
        a, b = int(self.starts[first]), int(self.starts[last])
        return Samples(self.ids[a:b], self.counted[a:b], self.starts[first:last + 1] - a, self.seq_len)

    def rows(self, index: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """(tokens, targets) int64 [len(index), seqLen] of these samples, padded with PAD_ID and IGNORE_INDEX."""
        ids = torch.full((len(index), self.seq_len + 1), PAD_ID, dtype=torch.long)
        labels = torch.full((len(index), self.seq_len + 1), IGNORE_INDEX, dtype=torch.long)
        for row, i in enumerate(index):
            a, b = int(self.starts[i]), int(self.starts[i + 1])
            ids[row, : b - a] = self.ids[a:b]
            labels[row, : b - a] = torch.where(self.counted[a:b], self.ids[a:b].long(), IGNORE_INDEX)
        return ids[:, :-1].contiguous(), labels[:, 1:].contiguous()


def build_samples(lines: list[Line], encoder: Encoder, seq_len: int, field: str) -> Samples:
    """Every line encoded and cut at seqLen+1 tokens; a sample left without a counted target is dropped (said in
    the log), none left is a ConfigError."""
    ids, counted, lengths, cut = [], [], [0], 0
    for line in lines:
        sample, mask = encoder.encode(line, field)
        cut += sample.numel() > seq_len + 1
        sample, mask = sample[: seq_len + 1], mask[: seq_len + 1]
        if bool(mask[1:].any()):  # the first token is never a target
            ids.append(sample.to(torch.int32))
            counted.append(mask)
            lengths.append(sample.numel())
    dropped = len(lines) - len(ids)
    log.info("%s: %d %s sample(s) of %d line(s); %d cut at seqLen+1 = %d tokens, %d left out (no counted token "
             "within them)", field, len(ids), encoder.format, len(lines), cut, seq_len + 1, dropped)
    if not ids:
        raise ConfigError(field, f"none of its {len(lines)} {encoder.format} sample(s) has a counted (assistant or "
                                 f"response) token within seqLen+1 = {seq_len + 1} tokens")
    return Samples(torch.cat(ids), torch.cat(counted), torch.tensor(lengths).cumsum(0), seq_len)


# --------------------------------------------------------------------------- the order


class ChatSampler:
    """Batches as a pure function of (seed, step), every sample once an epoch: ``micro_batches`` and ``close``
    as text.Sampler's, so the loop reads either the same way."""

    def __init__(self, samples: Samples, seed: int) -> None:
        self.samples = samples
        self.seed = seed
        self._orders: dict[int, list[int]] = {}

    def order(self, epoch: int) -> list[int]:
        """The epoch's permutation of the samples (the two used last are kept: a step mostly reads one epoch's)."""
        order = self._orders.pop(epoch, None)
        if order is None:
            gen = torch.Generator().manual_seed(step_seed(self.seed, epoch))
            order = torch.randperm(len(self.samples), generator=gen).tolist()
        self._orders[epoch] = order  # the newest last
        while len(self._orders) > 2:
            del self._orders[next(iter(self._orders))]
        return order

    def indices(self, first: int, count: int) -> list[int]:
        """Samples ``first`` to ``first + count`` of the endless sequence of epochs."""
        n = len(self.samples)
        return [self.order(g // n)[g % n] for g in range(first, first + count)]

    def micro_batches(
        self, step: int, micro_batch: int, grad_accum: int, world_size: int, rank: int
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(tokens, targets) int64 [micro_batch, seqLen] pairs: the rank's contiguous chunk of the step's global
        batch, split into grad_accum contiguous micro-batches."""
        per_rank = micro_batch * grad_accum
        tokens, targets = self.samples.rows(self.indices((step * world_size + rank) * per_rank, per_rank))
        return [(tokens[m * micro_batch : (m + 1) * micro_batch], targets[m * micro_batch : (m + 1) * micro_batch])
                for m in range(grad_accum)]

    def close(self) -> None:
        """Nothing to release."""


def eval_batches(held: Samples, spec: TrainingJobSpec, world_size: int, rank: int
                 ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """This rank's share of the fixed evaluation samples: evalBatches micro-batches of microBatchSize, the first
    ones of the held-out samples' seeded order (repeated when there are fewer)."""
    return ChatSampler(held, spec.seed).micro_batches(0, spec.micro_batch_size, spec.eval_batches, world_size, rank)


def split_eval(train: Samples, spec: TrainingJobSpec, encoder: Encoder) -> tuple[Samples, Samples | None]:
    """(training samples, evaluation samples): data.evalPath's, else the last HELD_OUT_FRACTION of the training
    samples (at least one), which are then not trained on. None without evalEverySteps."""
    if spec.eval_every_steps is None:
        return train, None
    seq_len = spec.model.seq_len
    if spec.data.eval_path is not None:
        held_data = spec.data.model_copy(update={"path": spec.data.eval_path})
        return train, build_samples(read_lines(held_data, "data.evalPath"), encoder, seq_len, "data.evalPath")
    held = max(1, int(len(train) * HELD_OUT_FRACTION))
    if held >= len(train):
        raise ConfigError("spec.evalEverySteps", f"holding out {held} of {len(train)} sample(s) for evaluation "
                                                 "leaves none to train on: set data.evalPath")
    return train.part(0, len(train) - held), train.part(len(train) - held, len(train))


def open_samples(spec: TrainingJobSpec) -> tuple[ChatSampler, Samples | None]:
    """data.path's samples (tokenised once, here) in their seeded order, and the evaluation samples."""
    encoder = Encoder.of(spec.data)
    samples = build_samples(read_lines(spec.data, "data.path"), encoder, spec.model.seq_len, "data.path")
    train, held = split_eval(samples, spec, encoder)
    return ChatSampler(train, spec.seed), held
