"""The ``strategy_config`` options core reads, declared once: rows per forward pass and chunked
log-probs (:class:`ScoringOptions`).

A strategy whose config offers them inherits :class:`ScoringOptions`; core reads them through
:func:`scoring_options`, typed, never a plugin's field by its name.
"""

from __future__ import annotations

from typing import Protocol

import attrs

from posttrain.config.ranges import at_least


@attrs.frozen(kw_only=True)
class ScoringOptions:
    """The forward-pass options of a strategy's ``strategy_config`` that core reads: rows per
    micro-batch (``posttrain.plan_micro_batches``) and log-probs a chunk of tokens at a time
    (``posttrain.logprob_forward``). A strategy config inherits this class (a subclass may
    redeclare a field to change its default)."""

    # Rows per forward pass; None: training_args.per_device_train_batch_size in a trainer, the
    # role's infer_batch_size (else the strategy's own default) in a scoring role.
    micro_batch_size: int | None = attrs.field(default=None, validator=at_least(1))
    # Rows per forward pass when computing log-probs or scores; None: micro_batch_size.
    logprob_micro_batch_size: int | None = attrs.field(default=None, validator=at_least(1))
    # Log-probs from the output head this many tokens at a time (forward and backward), never
    # the whole [tokens, vocab] float32 logits; 0: from the full logits, as before.
    logprob_chunk_tokens: int = attrs.field(
        default=1024, validator=at_least(1, also={0: "off: full logits"})
    )

    def scoring_rows(self) -> int | None:
        """Rows per log-prob (or score) forward pass: ``logprob_micro_batch_size``, else
        ``micro_batch_size``; None when neither is set (the caller's default applies)."""
        return self.logprob_micro_batch_size or self.micro_batch_size


# A strategy whose config has no scoring options: micro-batches from training_args or the role,
# log-probs from the full logits (as core did before these options were declared here).
NO_SCORING_OPTIONS = ScoringOptions(logprob_chunk_tokens=0)


class _HasConfig(Protocol):
    @property
    def config(self) -> object: ...


def scoring_options(worker: _HasConfig) -> ScoringOptions:
    """The role's ``strategy_config`` as :class:`ScoringOptions`: itself when its class inherits
    it, else :data:`NO_SCORING_OPTIONS` (no row counts set, full-logit log-probs)."""
    config = worker.config
    return config if isinstance(config, ScoringOptions) else NO_SCORING_OPTIONS
