"""``hf_infer``'s generation loop: a fixed number of rows in flight, each drawing one token per
step, with per-token log-probs.

Rows are filled from a queue of prompts (shortest first, when they do not all fit at once).
With the fixed-shape decoders of :mod:`~posttrain_hf_infer.static_decode`, a row whose sample
ended is refilled with the next prompt while the other rows go on (continuous batching): a
batch no longer runs as long as its longest sample with its ended rows decoding padding. The
dynamic cache (as ``generate``) cannot take a new prompt into one row: its rows are refilled
together, once all have ended.

Tokens and log-probs stay on the device; the host looks at which rows ended only every
``SYNC_EVERY`` steps on a GPU (a look waits for the GPU to drain) and then collects and refills
them.
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING

import torch

from posttrain import stop_string_start
from posttrain_hf_infer.static_decode import StaticDecoder, cache_argument, prompt_positions

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    from posttrain import SamplingParams
    from posttrain_hf_infer.token_sampling import Draw

# On a GPU, steps between the host's looks at which rows ended: in between it queues the next
# steps' kernels while the GPU runs the last ones.
SYNC_EVERY = 8
# Rows are refilled once this share of them (1/N) is free, or all the prompts left fit: each
# refill is a prefill of its own, run eagerly, so many one-row refills would cost more than
# the steps they save. Measured (benchmarks/continuous_batching.py --refill-shares, 1.5B, 256
# rows, H200): 1/2 to 1/8 within 5% of each other, 1/16 and 1/32 16-22% slower.
REFILL_SHARE = 8


def left_padded(
    prompts: list[list[int]], rows: int, pad_id: int, device: torch.device | str
) -> tuple[torch.Tensor, torch.Tensor]:
    """``[rows, width]`` token ids and attention mask, the prompts right-aligned (rows past
    the prompts are all padding). Built on the host as lists, each tensor copied to the device
    whole: a copy per prompt to a GPU took 70 us each, 9 ms of a 128-row rollout's 220 ms
    (1.5B, H200)."""
    width = max(len(p) for p in prompts)
    ids = [[pad_id] * (width - len(p)) + list(p) for p in prompts]
    seen = [[0] * (width - len(p)) + [1] * len(p) for p in prompts]
    ids += [[pad_id] * width] * (rows - len(prompts))
    seen += [[0] * width] * (rows - len(prompts))
    as_long = {"dtype": torch.long, "device": device}
    return torch.tensor(ids, **as_long), torch.tensor(seen, **as_long)


class DynamicDecode:
    """transformers' growing cache (as ``generate``): each step's shapes differ, and its rows
    are only refilled all together (a new cache)."""

    def __init__(self, model: PreTrainedModel, pad_id: int, device: torch.device | str) -> None:
        self.model, self.pad_id, self.device = model, pad_id, device
        self.cache_argument = cache_argument(model)

    def start(self, prompts: list[list[int]]) -> torch.Tensor:
        from transformers import DynamicCache

        input_ids, self.attention = left_padded(prompts, len(prompts), self.pad_id, self.device)
        self.cache = {self.cache_argument: DynamicCache(config=self.model.config)}
        self.position = prompt_positions(self.attention)
        return self._forward(input_ids)

    def _forward(self, ids: torch.Tensor, **extra: torch.Tensor) -> torch.Tensor:
        """The last position's logits of ``ids`` (``extra``: a prefill's image inputs)."""
        out = self.model(
            input_ids=ids,
            attention_mask=self.attention,
            position_ids=self.position,
            use_cache=True,
            logits_to_keep=1,
            **extra,
            **self.cache,
        )
        return out.logits[:, -1]

    def step(self, token: torch.Tensor, running: torch.Tensor) -> torch.Tensor:
        self.position = self.position[:, -1:] + 1
        self.attention = torch.cat([self.attention, running.long().unsqueeze(-1)], dim=-1)
        return self._forward(token.unsqueeze(-1))

    def observe(self, running: torch.Tensor) -> None:
        pass


class StaticDecode:
    """Generations on a :class:`~posttrain_hf_infer.static_decode.StaticDecoder` (its rows past
    those in flight decode padding, never read). ``routing``: keep each sample's routing (a
    mixture-of-experts model's, :mod:`~posttrain_hf_infer.moe_decode`), taken from its row's
    slots when the row ends (before a refill overwrites them)."""

    def __init__(
        self,
        decoder: StaticDecoder,
        pad_id: int,
        device: torch.device | str,
        routing: bool = False,
    ) -> None:
        self.decoder, self.pad_id, self.device = decoder, pad_id, device
        self.tokens = torch.full((decoder.rows,), pad_id, dtype=torch.long, device=device)
        self.running = torch.zeros(decoder.rows, dtype=torch.bool, device=device)
        if routing and decoder.routing is None:
            from posttrain.backend import routing_geometry

            routing_geometry(decoder.model)  # the user error naming why this model has none
        # Per sample (its prompt's place) once its row ended; per row, the slot its prompt
        # starts at and the width it was left-padded to.
        self.routing: dict[int, torch.Tensor] | None = {} if routing else None
        self.prompt_start = [0] * decoder.rows
        self.width = [0] * decoder.rows

    def start(self, prompts: list[list[int]]) -> torch.Tensor:
        input_ids, attention = left_padded(prompts, self.decoder.rows, self.pad_id, self.device)
        self.running.zero_()
        self._placed(list(range(len(prompts))), prompts)
        return self.decoder.prefill(input_ids, attention)

    def refill(self, rows: list[int], prompts: list[list[int]]) -> torch.Tensor:
        input_ids, attention = left_padded(prompts, len(prompts), self.pad_id, self.device)
        self._placed(rows, prompts)
        return self.decoder.refill(rows, input_ids, attention)

    def _placed(self, rows: list[int], prompts: list[list[int]]) -> None:
        width = max(len(p) for p in prompts)
        for row, prompt in zip(rows, prompts):
            self.prompt_start[row], self.width[row] = width - len(prompt), width

    def keep_routing(self, rows: list[int], owners: list[int], drawn: list[int]) -> None:
        """The routing of the samples of ``rows`` that ended (``drawn`` tokens each), kept for
        their prompts' places ``owners``: the prompt's slots and those of the response tokens
        fed back (all but the last)."""
        if self.routing is None or self.decoder.routing is None:
            return
        starts = [self.prompt_start[row] for row in rows]
        fed = [
            self.width[row] - start + max(n - 1, 0) for row, start, n in zip(rows, starts, drawn)
        ]
        samples = self.decoder.routing.samples(rows, starts, fed, drawn)
        self.routing.update(zip(owners, samples))

    def routings(self, count: int) -> list[torch.Tensor]:
        """The kept routing of samples ``0 .. count - 1`` (every row ended), on the host."""
        if self.routing is None:
            raise RuntimeError("hf_infer: this decode was not asked to keep routing")
        return [self.routing[owner] for owner in range(count)]

    def step(self, token: torch.Tensor, running: torch.Tensor) -> torch.Tensor:
        self.tokens[: len(token)] = token
        self.running[: len(running)] = running
        return self.decoder.step(self.tokens, self.running)

    def observe(self, running: torch.Tensor) -> None:
        """Tell the decoder where its rows are, ``running`` the rows in flight that still run
        (the decoder's other rows never do)."""
        live = torch.zeros(self.decoder.rows, dtype=torch.bool, device=self.device)
        live[: len(running)] = running
        self.decoder.observe(live)


class Rows:
    """The rows in flight: which prompt each holds (host), and their tokens, log-probs, lengths
    and whether they still run (device). One spare column: a row that ended goes on drawing
    (its draws land past its end, never read)."""

    def __init__(self, owners: list[int], steps: int, pad_id: int, device: torch.device) -> None:
        count = len(owners)
        self.owner: list[int | None] = list(owners)
        # On the host: steps recorded, the step each row was filled at, and the latest of those
        # among the rows holding a prompt (updated at fills and collections, not every step).
        self.recorded = 0
        self.filled_at = [0] * count
        self.youngest = 0
        self.tokens = torch.full((count, steps + 1), pad_id, dtype=torch.long, device=device)
        self.logps = torch.zeros((count, steps + 1), dtype=torch.float32, device=device)
        self.lengths = torch.zeros(count, dtype=torch.long, device=device)
        self.running = torch.ones(count, dtype=torch.bool, device=device)

    def __len__(self) -> int:
        return len(self.owner)

    def record(self, token: torch.Tensor, logp: torch.Tensor) -> None:
        at = self.lengths.unsqueeze(-1)
        self.tokens.scatter_(1, at, token.unsqueeze(-1))
        self.logps.scatter_(1, at, logp.unsqueeze(-1))
        self.lengths += self.running
        self.recorded += 1

    def all_ended_surely(self, steps: int) -> bool:
        """Every row holding a prompt has drawn ``steps`` tokens: ended, without a look."""
        return self.recorded - self.youngest >= steps

    def collect_ended(
        self,
        responses: list[list[int]],
        logprobs: list[list[float]],
        decode: DynamicDecode | StaticDecode | None = None,
    ) -> list[int]:
        """Hand the samples of the rows that ended to their prompts' places (and a
        :class:`StaticDecode` ``decode`` their routing, where it keeps it); the free rows."""
        ended = [
            (row, owner)
            for row, (live, owner) in enumerate(zip(self.running.tolist(), self.owner))
            if not live and owner is not None
        ]
        if ended:
            index = torch.tensor([row for row, _ in ended], device=self.lengths.device)
            counts = self.lengths[index].tolist()
            tokens, logps = self.tokens[index].tolist(), self.logps[index].tolist()
            for (row, owner), n, ids, lps in zip(ended, counts, tokens, logps):
                responses[owner], logprobs[owner] = ids[:n], lps[:n]
                self.owner[row] = None
            if isinstance(decode, StaticDecode):
                decode.keep_routing([row for row, _ in ended], [o for _, o in ended], counts)
            held = [at for at, owner in zip(self.filled_at, self.owner) if owner is not None]
            self.youngest = max(held, default=self.recorded)
        return [row for row, owner in enumerate(self.owner) if owner is None]

    def fill(self, rows: list[int], owners: list[int]) -> None:
        index = torch.tensor(rows, device=self.lengths.device)
        self.lengths[index] = 0
        self.running[index] = True
        for row, owner in zip(rows, owners):
            self.owner[row], self.filled_at[row] = owner, self.recorded
        self.youngest = self.recorded


def look_interval(device: torch.device, sampling: SamplingParams) -> int:
    """Steps between the host's looks at the rows: every step where the text must be read (stop
    strings) or looking costs nothing (the CPU), else ``SYNC_EVERY``."""
    return 1 if sampling.stop or device.type == "cpu" else SYNC_EVERY


def sample_rows(
    decode: DynamicDecode | StaticDecode,
    prompts: list[list[int]],
    order: list[int],
    pool: int,
    sampling: SamplingParams,
    stop_ids: set[int],
    tokenizer: PreTrainedTokenizerBase,
    draw: Draw,
    refill: bool,
) -> tuple[list[list[int]], list[list[float]]]:
    """Sample up to ``max_new_tokens`` for each of ``prompts``, taken in ``order`` into at most
    ``pool`` rows at a time; ``refill``: rows are refilled as they end (where ``decode`` can).
    The responses and their per-token log-probs, in the prompts' order; a response counts its
    tokens up to and including the one that stopped it."""
    steps, pad_id = sampling.max_new_tokens, tokenizer.pad_token_id
    device = torch.device(decode.device)
    stops = torch.tensor(sorted(stop_ids), dtype=torch.long, device=device) if stop_ids else None
    every = look_interval(device, sampling)
    # Only the fixed-shape decoders take a new prompt into a row while the others run.
    refilled = decode if refill and isinstance(decode, StaticDecode) else None
    queue = deque(order)
    responses: list[list[int]] = [[] for _ in prompts]
    logprobs: list[list[float]] = [[] for _ in prompts]

    def start() -> tuple[Rows, torch.Tensor]:
        owners = [queue.popleft() for _ in range(min(pool, len(queue)))]
        return Rows(owners, steps, pad_id, device), decode.start([prompts[i] for i in owners])

    rows, logits = start()
    tick = 0
    while True:
        token, token_logp = draw(logits[: len(rows)])
        rows.record(token, token_logp)
        if stops is not None:
            rows.running &= ~torch.isin(token, stops)
        rows.running &= rows.lengths < steps
        if sampling.stop:
            rows.running &= ~stop_strings_reached(rows, sampling.stop, tokenizer)
        tick += 1
        fed = torch.where(rows.running, token, pad_id)
        if tick % every and not rows.all_ended_surely(steps):
            logits = decode.step(fed, rows.running)
            continue
        free = rows.collect_ended(responses, logprobs, decode)
        if len(free) == len(rows):
            if not queue:
                return responses, logprobs
            rows, logits = start()
            continue
        decode.observe(rows.running)
        logits = decode.step(fed, rows.running)
        if (
            refilled is not None
            and queue
            and len(free) >= min(len(queue), max(1, len(rows) // REFILL_SHARE))
        ):
            # After the step: the refilled rows' prefill overwrites what the step wrote into
            # them (they stood still in it), and their first logits replace the step's.
            free = free[: len(queue)]
            owners = [queue.popleft() for _ in free]
            first = refilled.refill(free, [prompts[i] for i in owners])
            logits[torch.tensor(free, device=device)] = first
            rows.fill(free, owners)


def stop_strings_reached(
    rows: Rows, stop: tuple[str, ...], tokenizer: PreTrainedTokenizerBase
) -> torch.Tensor:
    """The rows still running whose text now contains a stop string. As vLLM: the text without
    special tokens; the token completing a stop string is the sample's last one. (Whole
    responses are decoded each step: simple, and cheap next to the forward pass at the lengths
    hf_infer serves.)"""
    running = [i for i, live in enumerate(rows.running.tolist()) if live]
    counts, tokens = rows.lengths.tolist(), rows.tokens.tolist()
    texts = tokenizer.batch_decode(
        [tokens[i][: counts[i]] for i in running], skip_special_tokens=True
    )
    reached = torch.zeros_like(rows.running)
    for i, text in zip(running, texts):
        if stop_string_start(text, stop) is not None:
            reached[i] = True
    return reached
