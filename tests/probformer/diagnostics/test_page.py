"""The diagnostics page and the ELBO figure say what is true of the schedule that ran:
the sequential schedule (coordinate ascent) never lowers the ELBO, so its reading says
"never falls"; an unrolled schedule can lower it, and its reading says so. Titles fit
inside their figures."""

import numpy as np
import pytest
import torch

import probformer as pf
from probformer import diagnostics
from probformer.diagnostics import plots


def report_of(schedule: str, weights: str = "crf", seed: int = 0):
    torch.manual_seed(seed)
    config = pf.PTConfig(
        vocab_size=30, labels=6, channels=2, rank=2, iterations=6, schedule=schedule, weights=weights, dropout=0.0
    )
    model = pf.ProbabilisticTransformer(config).eval()
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.mul_(4.0)  # strong couplings: updates that are not coordinate ascent overshoot
    tokens = torch.randint(0, 30, (6, 9), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        return diagnostics.report(model, tokens)


def falls(report) -> bool:
    """Whether the ELBO falls between two iterations anywhere, beyond float32 round-off."""
    elbo = report["sample_stats"]["elbo"].values[0]  # [sentence, iteration]
    return bool((np.diff(elbo, axis=1) < -1e-5 * np.abs(elbo).max()).any())


def test_coordinate_ascent_never_lowers_the_elbo_and_the_page_says_so(tmp_path):
    report = report_of("sequential", "crf")
    assert report["sample_stats"].attrs["coordinate_ascent"] == 1
    assert not falls(report)  # the claim the page makes, checked on the numbers
    diagnostics.plot_report(report, tmp_path)
    page = (tmp_path / "report.md").read_text()
    assert "Mean-field schedule: `sequential`" in page and "never falls" in page
    assert "never falls" in plots.elbo_title("sequential", 1)


def test_other_settings_are_not_called_monotone(tmp_path):
    reference = report_of("sequential", "reference")  # the PT's default weights: head logits times d
    assert reference["sample_stats"].attrs["coordinate_ascent"] == 0
    assert falls(reference)  # why the page must not promise a rising curve
    for report in (reference, report_of("async", "crf")):
        schedule = report["sample_stats"].attrs["schedule"]
        diagnostics.plot_report(report, tmp_path / schedule)
        page = (tmp_path / schedule / "report.md").read_text()
        assert f"Mean-field schedule: `{schedule}`" in page and "need not rise" in page and "never falls" not in page
    assert "need not rise" in plots.elbo_title("async", 0)


@pytest.mark.parametrize("coordinate_ascent", [0, 1])
def test_every_title_and_label_fits_inside_its_figure(tmp_path, coordinate_ascent, monkeypatch):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    report = report_of("async")  # short sentences: the Pareto-k title carries its note
    report["sample_stats"].attrs.update(coordinate_ascent=coordinate_ascent)  # both ELBO titles
    overflow = []
    real_savefig = matplotlib.figure.Figure.savefig

    def checked_savefig(figure, *args, **kwargs):
        figure.canvas.draw()
        renderer = figure.canvas.get_renderer()
        box = figure.bbox
        texts = list(figure.texts)
        for axis in figure.axes:
            texts += [axis.title, axis.xaxis.label, axis.yaxis.label]
            texts += axis.get_legend().get_texts() if axis.get_legend() else []
        for text in texts:
            if text.get_visible() and text.get_text().strip():
                extent = text.get_window_extent(renderer)
                inside = box.x0 - 1 <= extent.x0 and extent.x1 <= box.x1 + 1
                if not (inside and box.y0 - 1 <= extent.y0 and extent.y1 <= box.y1 + 1):
                    overflow.append(text.get_text())
        return real_savefig(figure, *args, **kwargs)

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", checked_savefig)
    diagnostics.plot_report(report, tmp_path)
    plt.close("all")
    assert overflow == []
