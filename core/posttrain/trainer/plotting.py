"""At the end of a run, plot reward, KL and entropy over steps into ``RUN_DIR/curves.png``; with
an environment, also the turns an episode took and the share of episodes that called a tool
(every environment logs both; a game's tool-call rate is flat at 0). The held-out datasets' rewards
(``val/<dataset>/reward_mean``) are drawn beside the train reward."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from posttrain.markers import hookimpl

if TYPE_CHECKING:
    from matplotlib.axes import Axes

CURVES = (("reward/mean", "reward"), ("actor/kl", "KL to reference"), ("actor/entropy", "entropy"))
# Shown only when the run measured them.
OPTIONAL_CURVES = (
    ("env/turns_mean", "turns per episode"),
    ("env/tool_call_rate", "tool-call rate"),
)


def curves_of(history: list[dict[str, float]]) -> list[tuple[str, str]]:
    """(metric, title) of each panel: the fixed ones, and the optional ones the run measured."""
    return [*CURVES, *((k, t) for k, t in OPTIONAL_CURVES if any(k in h for h in history))]


@hookimpl(trylast=True)
def posttrain_run_finished(run_dir: str, history: list[dict[str, float]]) -> None:
    if not history:
        return
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    curves = curves_of(history)
    fig, axes = plt.subplots(1, len(curves), figsize=(4 * len(curves), 3.2))
    for ax, (key, title) in zip(axes, curves):
        points = [(h["step"], h[key]) for h in history if key in h]
        if points:
            ax.plot(*zip(*points), linewidth=1.5, label="train")
        else:
            ax.text(0.5, 0.5, "not measured", ha="center", va="center", transform=ax.transAxes)
        if key == "reward/mean":
            _plot_held_out(ax, history)
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(os.path.join(run_dir, "curves.png"), dpi=100)
    plt.close(fig)


def _plot_held_out(ax: Axes, history: list[dict[str, float]]) -> None:
    """Each held-out dataset's reward at the steps it was evaluated, and a legend."""
    keys = sorted({k for h in history for k in h if k.startswith("val/")})
    for key in (k for k in keys if k.endswith("/reward_mean")):
        points = [(h["step"], h[key]) for h in history if key in h]
        name = key.removeprefix("val/").removesuffix("/reward_mean")
        # "eval: NAME", beside "train": the dataset's own name often says "held out" already.
        ax.plot(*zip(*points), marker="o", markersize=3, linewidth=1, label=f"eval: {name}")
    if keys:
        ax.legend(fontsize=7)
