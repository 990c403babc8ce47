"""curves.png: the right panel shows the validation metric the run logs, whatever its task."""

import pytest

from flashtrain.train.metrics import plot_curves, right_panel


@pytest.mark.parametrize("val_metrics, expected", [
    ({"val_ppl": 40.0}, "ppl"),
    ({"val_accuracy": 0.5}, "accuracy"),
    ({"val_mlm_accuracy": 0.3}, "mlm_accuracy"),  # BERT pretraining: the panel was empty
    ({"val_micro_f1": 0.4, "val_macro_f1": 0.2}, "micro_f1"),  # long documents: the panel was empty
    ({}, "loss"),
])
def test_right_panel_shows_the_logged_metric(tmp_path, val_metrics, expected):
    records = [{"step": 0, "tokens": 0, "val_loss": 2.0, **val_metrics},
               {"step": 5, "tokens": 500, "train_loss": 1.5},
               {"step": 5, "tokens": 500, "val_loss": 1.4, **{k: v * 1.1 for k, v in val_metrics.items()}}]
    metric, name, title, log_scale = right_panel({"run": records})
    assert metric == expected and log_scale == (expected == "ppl")
    assert title == f"validation {name}"  # no test value logged: no star to explain
    assert sum("val_" + metric in r for r in records) == 2  # the two points the panel draws
    plot_curves({"run": records}, tmp_path / "curves.png")
    assert (tmp_path / "curves.png").stat().st_size > 10_000


@pytest.mark.parametrize("test_metrics, title", [
    ({}, "validation masked-LM accuracy"),  # BERT pretraining has no test split: no "(star: test)" in its title
    ({"test_loss": 1.2, "test_mlm_accuracy": 0.4}, "validation masked-LM accuracy (star: test)"),
])
def test_right_panel_title_names_the_star_only_with_a_test_value(test_metrics, title):
    records = [{"step": 0, "tokens": 0, "val_loss": 2.0, "val_mlm_accuracy": 0.1},
               {"step": 5, "tokens": 500, "train_loss": 1.5},
               {"step": 5, "tokens": 500, "val_loss": 1.4, "val_mlm_accuracy": 0.3, **test_metrics}]
    assert right_panel({"run": records}) == ("mlm_accuracy", "masked-LM accuracy", title, False)
