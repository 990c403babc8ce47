"""Scoring a whole split in one process, through the trainer's own `evaluate` (what a run logs)."""

from flashtrain.train.trainer import evaluate


def evaluate_split(model, task, split: str, batch_size: int) -> dict[str, float]:
    """{"loss", "accuracy", "samples"} of `model` over every sample of `split` ("val", "test")."""
    loader = task.eval_loader(split, batch_size)
    metrics = evaluate(model, loader, task)
    return {"loss": metrics["val_loss"], "accuracy": metrics["val_accuracy"],
            "samples": sum(len(labels) for _, labels in loader)}
