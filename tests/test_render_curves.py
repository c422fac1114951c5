def test_curves_plot_the_first_informative_score():
    from tformer_cli.render_curves import score_to_plot

    translation = [{"loss": 2.0, "bleu": 30.5, "chrf": 55.0, "exact_match": 4.0}]
    numbers = [{"loss": 0.1, "bleu": 0.0, "chrf": 99.0, "exact_match": 98.0}, {"loss": 0.1, "bleu": 0.0}]
    assert score_to_plot(translation) == "bleu"
    assert score_to_plot(numbers) == "exact_match"
    assert score_to_plot([{"loss": 1.0, "bleu": 0.0, "chrf": 12.0}]) == "chrf"
    assert score_to_plot([{"loss": 1.0}]) is None


def test_curves_are_drawn_once_laid_out_as_tight_layout_lays_them_out(tmp_path, monkeypatch):
    """files.write_figure lays a figure out itself: fig.tight_layout() would leave a placeholder layout
    engine, for which savefig draws the figure twice."""
    from matplotlib.figure import Figure

    from tformer_cli.render_curves import plot_curves

    records = [{"split": "train", "step": s, "loss": 3.0 / s} for s in (1, 2, 3)]
    records += [{"split": "validation", "step": 3, "loss": 1.5, "bleu": 12.0}]
    draw, drawn, placed = Figure.draw, [], []

    def counted(figure, renderer):
        drawn.append(1)
        placed.append([ax.get_position().bounds for ax in figure.axes])
        return draw(figure, renderer)

    monkeypatch.setattr(Figure, "draw", counted)
    plot_curves(records, tmp_path / "curves.png", "run")
    assert len(drawn) == 1

    class TightLayout:  # the figure's own tight_layout (figure.py holds its own TightLayoutEngine)
        def execute(self, figure):
            figure.tight_layout()

    monkeypatch.setattr("matplotlib.layout_engine.TightLayoutEngine", TightLayout)
    plot_curves(records, tmp_path / "reference.png", "run")
    assert len(drawn) == 3 and placed[1] == placed[0]  # tight_layout's own: the same places, drawn twice
