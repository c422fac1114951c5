import torch

from tformer_cli.ema import WeightEMA


def test_weight_ema_follows_its_formula_and_lends_the_model_its_weights():
    model = torch.nn.Linear(3, 2)
    start = [p.detach().clone() for p in model.parameters()]
    ema = WeightEMA(model, decay=0.5)
    expected = start
    for t in range(1, 5):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(float(t))
        ema.update()
        decay = min(0.5, (1 + t) / (10 + t))
        expected = [decay * e + (1 - decay) * p.detach() for e, p in zip(expected, model.parameters())]
    live = [p.detach().clone() for p in model.parameters()]
    with ema.applied():
        for p, e in zip(model.parameters(), expected):
            torch.testing.assert_close(p.detach(), e)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), live))
