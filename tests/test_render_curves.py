def test_curves_plot_the_first_informative_score():
    from tformer_cli.render_curves import score_to_plot

    translation = [{"loss": 2.0, "bleu": 30.5, "chrf": 55.0, "exact_match": 4.0}]
    numbers = [{"loss": 0.1, "bleu": 0.0, "chrf": 99.0, "exact_match": 98.0}, {"loss": 0.1, "bleu": 0.0}]
    assert score_to_plot(translation) == "bleu"
    assert score_to_plot(numbers) == "exact_match"
    assert score_to_plot([{"loss": 1.0, "bleu": 0.0, "chrf": 12.0}]) == "chrf"
    assert score_to_plot([{"loss": 1.0}]) is None
