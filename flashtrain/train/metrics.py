"""Run metrics: appended to metrics.jsonl as they come, plotted to PNG at the end."""

from __future__ import annotations

import json
from pathlib import Path


def read_records(path: Path) -> tuple[list[dict], bool]:
    """(the records of a metrics.jsonl, whether its last line was cut short and left out). Any other line that is not
    a JSON record is an error naming the file and the line."""
    lines = [line for line in Path(path).read_text().splitlines() if line.strip()]
    records = []
    for number, line in enumerate(lines, start=1):
        try:
            records.append(json.loads(line))
        except ValueError as error:
            if number == len(lines):
                return records, True
            raise ValueError(f"{path}, line {number}: not a JSON record ({error})") from None
    return records, False


class MetricsLog:
    def __init__(self, path: Path, enabled: bool = True, resumed_step: int | None = None):
        """A run resumed in its own directory (resumed_step: its checkpoint's step) appends to the same file; records
        after that step (work lost with the interruption, about to be redone) are dropped first, and so is a last
        line cut short by a kill (it was written after the checkpoint)."""
        self.path = Path(path)
        self.enabled = enabled
        self.records: list[dict] = []
        if enabled and self.path.is_file():
            self.records, torn = read_records(self.path)
            kept = [r for r in self.records if resumed_step is None or r["step"] <= resumed_step]
            if torn or len(kept) < len(self.records):
                self.records = kept
                tmp = self.path.with_name(f".tmp-{self.path.name}")
                tmp.write_text("".join(json.dumps(r) + "\n" for r in self.records))
                tmp.replace(self.path)

    def write(self, record: dict) -> None:  # one line per record: a kill can cut only the last one
        self.records.append(record)
        if self.enabled:
            with open(self.path, "a") as f:
                f.write(json.dumps(record) + "\n")

    def plot(self, png: Path, title: str) -> None:
        """Training loss and validation perplexity against tokens seen."""
        if not self.enabled:
            return
        plot_curves({title: self.records}, png)


# the right panel's metric: the first of these that the runs log (language models, classifiers, masked LMs,
# multi-label documents), with its name and whether it is plotted on a log scale
RIGHT_PANEL_METRICS = (("ppl", "perplexity", True), ("accuracy", "accuracy", False),
                       ("mlm_accuracy", "masked-LM accuracy", False), ("micro_f1", "micro-F1", False))


def right_panel(runs: dict[str, list[dict]]) -> tuple[str, str, str, bool]:
    """(metric name without "val_", axis label, panel title, log scale) of the runs' validation curve; the title
    names the star only when a run logs the test split's value (classifiers, at the end of a run)."""
    logged = {key for records in runs.values() for r in records for key in r}
    metric, name, log_scale = next((m for m in RIGHT_PANEL_METRICS if "val_" + m[0] in logged),
                                   ("loss", "loss", False))
    return metric, name, f"validation {name}" + (" (star: test)" if "test_" + metric in logged else ""), log_scale


def plot_curves(runs: dict[str, list[dict]], png: Path) -> None:
    """One PNG with train loss (left) and a validation metric (right: perplexity, log scale, for language models;
    else accuracy, masked-LM accuracy or micro-F1, whichever the runs log; the test split's value as a star) of one or
    more runs against tokens seen."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_loss, ax_val) = plt.subplots(1, 2, figsize=(11, 4))
    metric, name, title, log_scale = right_panel(runs)
    for label, records in runs.items():
        train = [r for r in records if "train_loss" in r]
        ax_loss.plot([r["tokens"] for r in train], [r["train_loss"] for r in train], label=label)
        val = [r for r in records if "val_" + metric in r]
        ax_val.plot([r["tokens"] for r in val], [r["val_" + metric] for r in val], marker="o", label=label)
        for r in (r for r in records if "test_" + metric in r):
            ax_val.plot([r["tokens"]], [r["test_" + metric]], marker="*", markersize=14, linestyle="none",
                        label=f"{label}: test {metric.replace('_', ' ')} {r['test_' + metric]:.4f}")
    ax_loss.set(xlabel="tokens", ylabel="train loss", title="training loss")
    ax_val.set(xlabel="tokens", ylabel=name, title=title, yscale="log" if log_scale else "linear")
    save_figure(fig, (ax_loss, ax_val), png)


def save_figure(fig, axes, png: Path) -> None:
    """Grid and legend on every panel of `axes`, then `fig` written to `png` and closed (the curve plots' finish)."""
    import matplotlib.pyplot as plt

    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)
