"""pass@k and mean@n of groups of ``n`` scored samples per prompt.

pass@k is the chance that at least one of ``k`` samples drawn without replacement from a
prompt's ``n`` solves it. With ``c`` of the ``n`` solved, the unbiased estimator of Chen et al.
(2021, "Evaluating Large Language Models Trained on Code") is ``1 - C(n-c, k) / C(n, k)``,
averaged over prompts. mean@n is the mean reward of a prompt's ``n`` samples, averaged over
prompts (verl's mean@N).
"""

from __future__ import annotations

from collections.abc import Sequence


def pass_at_k(n: int, c: int, k: int) -> float:
    """``1 - C(n-c, k) / C(n, k)``, as the product ``prod_{i=n-c+1}^{n} (1 - k/i)`` (no large
    binomials): exact in exact arithmetic, stable in floats."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n} c={c} k={k}")
    if n - c < k:
        return 1.0  # every k-subset holds a solved sample
    product = 1.0
    for i in range(n - c + 1, n + 1):
        product *= 1.0 - k / i
    return 1.0 - product


def k_values(n: int) -> list[int]:
    """The k logged for ``n`` samples per prompt: 1, 2, 4, ... below n, and n."""
    ks, k = [], 1
    while k < n:
        ks.append(k)
        k *= 2
    return [*ks, n]


def group_metrics(
    rewards: Sequence[float], lengths: Sequence[int], n: int, pass_reward: float
) -> dict[str, float]:
    """The metrics of prompts with ``n`` adjacent samples each: ``reward_mean``, ``mean@n``,
    ``pass@k`` for :func:`k_values`, ``response_length_mean``, ``prompts``."""
    if not rewards or len(rewards) % n or len(lengths) != len(rewards):
        raise ValueError(f"{len(rewards)} rewards are not whole groups of {n} samples")
    groups = [rewards[i : i + n] for i in range(0, len(rewards), n)]
    solved = [sum(r >= pass_reward for r in group) for group in groups]
    out = {
        "reward_mean": sum(rewards) / len(rewards),
        f"mean@{n}": sum(sum(g) / n for g in groups) / len(groups),
        "response_length_mean": sum(lengths) / len(lengths),
        "prompts": float(len(groups)),
    }
    for k in k_values(n):
        out[f"pass@{k}"] = sum(pass_at_k(n, c, k) for c in solved) / len(groups)
    return out
