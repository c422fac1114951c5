import html
import json
import math
import re

import pytest
import torch
from rich.console import Console
from typer.testing import CliRunner

from conftest import tiny_model_config
from tformer_cli.cli import app
from tformer_cli.errors import UsageError
from tformer_cli.introspect import AttentionMap, capture_attention, maps_to_json, select_maps
from tformer_cli.model import build_model
from tformer_cli.render_attention import print_maps, save_image
from tformer_cli.tokenizer import Vocabulary

TEXTS = ["three hundred forty-two thousand fifteen", "dreihundertzweiundvierzigtausendfünfzehn", "twenty-one",
         "einundzwanzig"]


@pytest.fixture(scope="module")
def setup():
    torch.manual_seed(0)
    vocab = Vocabulary.train([(TEXTS[0], TEXTS[1]), (TEXTS[2], TEXTS[3])], vocab_size=60, min_frequency=1)
    model = build_model(tiny_model_config(num_encoder_layers=2, num_decoder_layers=3), vocab.src_size).eval()
    return model, vocab


def test_captured_maps_are_distributions_with_causal_and_padding_structure(setup):
    model, vocab = setup
    capture = capture_attention(model, vocab, TEXTS[0], TEXTS[1])
    S, T = len(capture.source_tokens), len(capture.decoder_inputs)
    assert capture.encoder.shape == (2, 4, S, S) and capture.decoder.shape == (3, 4, T, T)
    assert capture.cross.shape == (3, 4, T, S)
    for weights in (capture.encoder, capture.decoder, capture.cross):
        torch.testing.assert_close(weights.sum(-1), torch.ones(weights.shape[:-1]))
    assert torch.all(capture.decoder.triu(1) == 0)
    assert capture.decoder_outputs[-1] == "</s>" and capture.decoder_inputs[0] == "<s>"
    src = torch.tensor([vocab.encode_sources([TEXTS[2]])[0] + [0, 0, 0]])  # padded keys get no weight
    assert torch.all(model.encode(src, need_weights=True).attention[0][..., -3:] == 0)


def test_captured_weights_equal_softmax_of_q_and_k_computed_by_hand(setup):
    model, vocab = setup
    capture = capture_attention(model, vocab, TEXTS[2], TEXTS[3])
    src = torch.tensor([vocab.encode_sources([TEXTS[2]])[0]])
    tgt_in = torch.tensor([vocab.encode_targets([TEXTS[3]])[0][:-1]])
    H, d_k = 4, 8

    def heads(x):  # (1, T, d) -> (H, T, d_k)
        return x.view(x.shape[1], H, d_k).transpose(0, 1)

    def by_hand(q, k, causal=False):
        scores = heads(q) @ heads(k).transpose(-1, -2) / math.sqrt(d_k)
        if causal:
            scores = scores.masked_fill(torch.ones_like(scores, dtype=torch.bool).triu(1), float("-inf"))
        return scores.softmax(-1)

    with torch.no_grad():
        x = model.encoder.embed(src)
        q, k, _ = model.encoder.layers[0].self_attn.qkv_proj(x).chunk(3, dim=-1)
        torch.testing.assert_close(capture.encoder[0], by_hand(q, k), atol=1e-5, rtol=1e-5)
        memory = model.encode(src).memory
        y = model.decoder.embed(tgt_in)
        layer = model.decoder.layers[0]
        q, k, _ = layer.self_attn.qkv_proj(y).chunk(3, dim=-1)
        torch.testing.assert_close(capture.decoder[0], by_hand(q, k, causal=True), atol=1e-5, rtol=1e-5)
        h = layer.norm1(y + layer.self_attn(y, is_causal=True)[0])  # post-LN output of the first sublayer
        k_mem, _ = layer.cross_attn.kv_proj(memory).chunk(2, dim=-1)
        torch.testing.assert_close(capture.cross[0], by_hand(layer.cross_attn.q_proj(h), k_mem), atol=1e-5, rtol=1e-5)


def test_without_a_target_the_greedy_output_is_used(setup):
    model, vocab = setup
    capture = capture_attention(model, vocab, TEXTS[2])
    assert capture.decoder.shape[-1] == len(capture.decoder_inputs) >= 1


def test_selection_of_layers_and_heads(setup):
    model, vocab = setup
    capture = capture_attention(model, vocab, TEXTS[0], TEXTS[1])
    assert len(select_maps(capture, "cross", "all", "mean")) == 3
    assert len(select_maps(capture, "encoder", "2", "all")) == 4
    one = select_maps(capture, "decoder", "last", "2")
    assert one[0].layer == 3 and one[0].head == 2 and torch.equal(one[0].weights, capture.decoder[2, 1])
    mean = select_maps(capture, "cross", "1", "mean")[0]
    torch.testing.assert_close(mean.weights, capture.cross[0].mean(0))
    for args, message in [(("cross", "4", "mean"), "out of range; the model has 3 layers"),
                          (("cross", "1", "9"), "out of range; the model has 4 heads"),
                          (("keys", "1", "1"), "expected one of cross, encoder, decoder"),
                          (("cross", "x", "1"), "expected N, last, all")]:
        with pytest.raises(UsageError, match=message):
            select_maps(capture, *args)
    data = json.loads(json.dumps(maps_to_json(capture, "cross", mean_maps := select_maps(capture, "cross"))))
    assert len(data["maps"]) == len(mean_maps) and data["column_tokens"] == capture.source_tokens


@pytest.mark.parametrize("width", [40, 80, 200])
@pytest.mark.parametrize("values", [False, True])
@pytest.mark.parametrize("colour", [False, True])
def test_terminal_heatmap_fits_the_width_and_shows_labels(setup, width, values, colour):
    model, vocab = setup
    capture = capture_attention(model, vocab, TEXTS[0], TEXTS[1])
    console = Console(record=True, width=width, force_terminal=colour, no_color=not colour,
                      color_system="truecolor" if colour else None)
    print_maps(select_maps(capture, "cross", "all", "all"), console, values)  # heads side by side where they fit
    text = console.export_text()
    assert all(len(line) <= width for line in text.splitlines())
    assert capture.decoder_outputs[0][:6] in text  # row labels
    assert "(max)" in text or width < 40
    if width == 40 and values:
        assert "not shown" in text  # a window of keys, with a visible note
    if width == 200:
        assert any(line.count("(max)") >= 2 for line in text.splitlines())  # small multiples in a row


def test_image_is_written(setup, tmp_path):
    model, vocab = setup
    capture = capture_attention(model, vocab, TEXTS[0], TEXTS[1])
    maps = select_maps(capture, "encoder", "all", "all")
    for name in ("grid.png", "grid.svg"):
        save_image(maps, tmp_path / name)
        assert (tmp_path / name).stat().st_size > 1000
    # a vector image holds each map's weights as they are, a pixel a cell, and its colour bars as vectors:
    # a rasterized bar renders the whole figure as pixels once per bar (seconds a map)
    images = re.findall(r'<image\b[^>]*?width="([\d.]+)" height="([\d.]+)"', (tmp_path / "grid.svg").read_text())
    assert images == [(str(len(m.columns)), str(len(m.rows))) for m in maps]


def _png_size(path) -> tuple[int, int]:
    header = path.read_bytes()[16:24]  # the IHDR chunk: width, height
    return int.from_bytes(header[:4], "big"), int.from_bytes(header[4:], "big")


def _svg_texts(path) -> list[str]:
    """The texts of a matplotlib .svg, in drawing order (each glyph group follows a comment of its text)."""
    return [html.unescape(text) for text in re.findall(r"<!-- (.*?) -->", path.read_text())]


@pytest.mark.parametrize("same_sentence", [True, False])
def test_maps_of_one_sentence_are_labelled_on_the_grids_edges_and_others_each_on_its_own(tmp_path, same_sentence):
    """Small multiples: keys under each column's lowest map, queries left of each row's first map (base's 48
    maps took twice as long to draw with every map labelled); maps of different tokens keep their own."""
    def tokens(layer, head, side):
        return [f"{side}{i}" + ("" if same_sentence else f"·{layer}.{head}") for i in range(3)]

    maps = [AttentionMap(title=f"layer {layer} head {head}", layer=layer, head=head, rows=tokens(layer, head, "q"),
                         columns=tokens(layer, head, "k"), weights=torch.full((3, 3), 1 / 3))
            for layer in (1, 2) for head in (1, 2, 3)]
    save_image(maps, tmp_path / "grid.svg")
    texts = _svg_texts(tmp_path / "grid.svg")
    labels = [t for t in texts if t[0] in "qk"]
    if same_sentence:
        assert sorted(labels) == sorted(["q0", "q1", "q2"] * 2 + ["k0", "k1", "k2"] * 3)  # a row's, a column's
    else:
        assert sorted(labels) == sorted(t for m in maps for t in m.rows + m.columns)
    assert [t for t in texts if t.startswith("layer")] == [m.title for m in maps]  # every map keeps its title


def test_a_png_of_many_or_long_maps_is_drawn_within_a_pixel_budget_and_says_when_its_labels_are_unreadable(
        setup, trained_run, tmp_path, monkeypatch):
    """At 150 dpi base's 48 maps of a 30-token sentence made a 106 M-pixel .png, and the 6 layers of a
    250-token sentence 690 M pixels (7 GB to draw): a larger grid now gets fewer dots an inch, a .svg keeps
    every label as text whatever its size, and the command says when a .png's labels cannot be read."""
    import tformer_cli.render_attention as render_attention

    model, vocab = setup
    maps = select_maps(capture_attention(model, vocab, TEXTS[0], TEXTS[1]), "encoder", "all", "all")
    assert save_image(maps, tmp_path / "full.png") == 150  # within the budget
    width, height = _png_size(tmp_path / "full.png")
    monkeypatch.setattr(render_attention, "IMAGE_PIXELS", width * height // 4)
    assert save_image(maps, tmp_path / "capped.png") == pytest.approx(75, rel=0.01)
    assert _png_size(tmp_path / "capped.png") == pytest.approx((width / 2, height / 2), abs=1)  # the same figure
    assert save_image(maps, tmp_path / "grid.svg") == 150  # labels as text, weights as they are
    for budget, warned in ((10 ** 9, False), (10 ** 4, True)):
        monkeypatch.setattr(render_attention, "IMAGE_PIXELS", budget)
        result = CliRunner().invoke(app, ["inspect-attention", str(trained_run), "twenty-one", "--head", "all",
                                          "--save", str(tmp_path / "cli.png")])
        assert result.exit_code == 0, result.output
        assert ("token labels, which are left out; a .svg or .pdf keeps them" in result.stderr) == warned, result.stderr


def test_an_image_is_drawn_once_laid_out_as_tight_layout_lays_it_out(setup, tmp_path, monkeypatch):
    """savefig draws a figure twice when it has a layout engine, and tight_layout leaves one: the image is
    laid out as tight_layout would lay it out, and drawn once."""
    from matplotlib.figure import Figure

    model, vocab = setup
    maps = select_maps(capture_attention(model, vocab, TEXTS[0], TEXTS[1]), "encoder", "1", "1")
    draw, drawn, placed = Figure.draw, [], {}

    def counted(figure, renderer):
        drawn.append(1)
        placed.setdefault("positions", [ax.get_position().bounds for ax in figure.axes])
        return draw(figure, renderer)

    monkeypatch.setattr(Figure, "draw", counted)
    save_image(maps, tmp_path / "grid.png")
    assert len(drawn) == 1
    ours = placed.pop("positions")

    class TightLayout:  # the figure's own tight_layout (figure.py holds its own TightLayoutEngine)
        def execute(self, figure):
            figure.tight_layout()

    monkeypatch.setattr("matplotlib.layout_engine.TightLayoutEngine", TightLayout)
    save_image(maps, tmp_path / "reference.png")
    assert len(drawn) == 3 and placed["positions"] == ours  # tight_layout's own: the same places, drawn twice


def test_inspect_attention_cli(trained_run, tmp_path):
    runner = CliRunner()
    image = tmp_path / "attention.png"
    result = runner.invoke(app, ["inspect-attention", str(trained_run), "twenty-one", "--head", "all",
                                 "--save", str(image)])
    assert result.exit_code == 0, result.output
    assert "cross layer 1, head 4" in result.output and "(max)" in result.output
    assert image.stat().st_size > 1000
    raw = runner.invoke(app, ["inspect-attention", str(trained_run), "seven", "--target", "sieben", "--kind",
                              "decoder", "--layer", "1", "--json"])
    data = json.loads(raw.stdout)
    assert data["kind"] == "decoder" and data["row_tokens"][0] == "<s>" and len(data["maps"]) == 1
    assert raw.stderr == ""
    unspellable = runner.invoke(app, ["inspect-attention", str(trained_run), "seven", "--target", "sieben €", "--json"])
    assert unspellable.exit_code == 0 and "<unk>" in json.loads(unspellable.stdout)["row_tokens"]
    assert unspellable.stderr.strip() == ("warning: --target: the run's target vocabulary has no token for '€'; the "
                                          "maps show <unk> there")
    encoder = runner.invoke(app, ["inspect-attention", str(trained_run), "seven", "--target", "sieben €",
                                  "--kind", "encoder", "--json"])
    assert encoder.exit_code == 0 and encoder.stderr == ""  # the target is in no encoder map
    for flags, message in ((["--layer", "5"], "--layer 5: out of range; the model has 1 layers"),
                           (["--kind", "self"], "--kind self: expected one of cross, encoder, decoder")):
        for target in ([], ["--target", "sieben €"]):  # the one line alone, without the target's warning
            bad = runner.invoke(app, ["inspect-attention", str(trained_run), "seven", *flags, *target])
            assert bad.exit_code == 1 and len(bad.output.strip().splitlines()) == 1 and message in bad.output


def test_inspect_attention_cli_errors(tmp_path):
    runner = CliRunner()
    result = runner.invoke(app, ["inspect-attention", str(tmp_path / "missing"), "seven"])
    assert result.exit_code == 1 and "no such run folder" in result.output
