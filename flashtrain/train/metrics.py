"""Run metrics: appended to metrics.jsonl as they come, plotted to PNG at the end."""

from __future__ import annotations

import json
from pathlib import Path


class MetricsLog:
    def __init__(self, path: Path, enabled: bool = True, resumed_step: int | None = None):
        """A run resumed in its own directory (resumed_step: its checkpoint's step) appends to the same file; records
        after that step (work lost with the interruption, about to be redone) are dropped first."""
        self.path = Path(path)
        self.enabled = enabled
        self.records: list[dict] = []
        if enabled and self.path.is_file():
            self.records = [json.loads(line) for line in self.path.read_text().splitlines() if line.strip()]
            if resumed_step is not None and any(r["step"] > resumed_step for r in self.records):
                self.records = [r for r in self.records if r["step"] <= resumed_step]
                tmp = self.path.with_name(f".tmp-{self.path.name}")
                tmp.write_text("".join(json.dumps(r) + "\n" for r in self.records))
                tmp.replace(self.path)

    def write(self, record: dict) -> None:
        self.records.append(record)
        if self.enabled:
            with open(self.path, "a") as f:
                f.write(json.dumps(record) + "\n")

    def plot(self, png: Path, title: str) -> None:
        """Training loss and validation perplexity against tokens seen."""
        if not self.enabled:
            return
        plot_curves({title: self.records}, png)


def plot_curves(runs: dict[str, list[dict]], png: Path) -> None:
    """One PNG with train loss (left) and validation perplexity (right, log scale) of one or more runs; runs that log
    accuracy instead (classification) plot validation accuracy on the right, and the test accuracy as a star."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_loss, ax_ppl) = plt.subplots(1, 2, figsize=(11, 4))
    accuracy = not any("val_ppl" in r for records in runs.values() for r in records)
    for label, records in runs.items():
        train = [r for r in records if "train_loss" in r]
        ax_loss.plot([r["tokens"] for r in train], [r["train_loss"] for r in train], label=label)
        if accuracy:
            val = [r for r in records if "val_accuracy" in r]
            ax_ppl.plot([r["tokens"] for r in val], [r["val_accuracy"] for r in val], marker="o", label=label)
            for r in (r for r in records if "test_accuracy" in r):
                ax_ppl.plot([r["tokens"]], [r["test_accuracy"]], marker="*", markersize=14, linestyle="none",
                            label=f"{label}: test accuracy {r['test_accuracy']:.4f}")
        else:
            val = [r for r in records if "val_ppl" in r]
            ax_ppl.plot([r["tokens"] for r in val], [r["val_ppl"] for r in val], marker="o", label=label)
    ax_loss.set(xlabel="tokens", ylabel="train loss", title="training loss")
    if accuracy:
        ax_ppl.set(xlabel="tokens", ylabel="accuracy", title="validation accuracy (star: test)")
    else:
        ax_ppl.set(xlabel="tokens", ylabel="validation perplexity", title="validation perplexity", yscale="log")
    for ax in (ax_loss, ax_ppl):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)
