"""Attention heatmaps: in the terminal with Rich, and as images with matplotlib (imported lazily).

Rows are queries, columns are keys; column labels are written vertically above the grid. Shading
is scaled to each map's largest weight (the legend gives it); the strongest key of each query is
marked. Without colour (NO_COLOR, a pipe, a file) cells are drawn with the characters " ░▒▓█".
Maps wider than the console show a window of keys, and say so.
"""

from __future__ import annotations

import math
from pathlib import Path

from rich.console import Console, Group
from rich.text import Text

from tformer_cli.files import write_figure
from tformer_cli.introspect import AttentionMap

# viridis anchors: dark purple -> blue -> green -> yellow
RAMP = [(68, 1, 84), (59, 82, 139), (33, 145, 140), (94, 201, 98), (253, 231, 37)]
SHADES = " ░▒▓█"
LABEL_WIDTH, LABEL_HEIGHT, MAX_ROWS = 12, 8, 64
# A .png of maps is drawn at IMAGE_DPI unless it would hold more than IMAGE_PIXELS: at 150 dpi base's 48
# maps of a 30-token sentence took 106 M pixels (PIL warns of a "decompression bomb" past 89 M), and the
# 6 layers of a 250-token one 690 M, 7 GB of memory and a minute to draw. Larger grids get fewer dots
# an inch; below READABLE_DPI their 8-point labels are under 7 pixels tall.
IMAGE_DPI, IMAGE_PIXELS, READABLE_DPI = 150, 40_000_000, 64


def _colour(level: float) -> str:
    """Hex colour for level in [0, 1] along the ramp."""
    position = min(max(level, 0.0), 1.0) * (len(RAMP) - 1)
    i = min(int(position), len(RAMP) - 2)
    frac = position - i
    r, g, b = (round(a + (b - a) * frac) for a, b in zip(RAMP[i], RAMP[i + 1]))
    return f"#{r:02x}{g:02x}{b:02x}"


def _label(token: str, width: int) -> str:
    token = token.replace("\n", " ")
    return token if len(token) <= width else token[: width - 1] + "…"


def heatmap(amap: AttentionMap, console: Console, values: bool = False) -> Group:
    """One map as Rich renderables that fit ``console.width``."""
    plain = console.no_color or console.color_system is None
    weights = amap.weights
    n_rows, n_cols = weights.shape
    label_w = min(LABEL_WIDTH, max(len(t) for t in amap.rows))
    cell = 4 if values else 2
    fit = max(1, (console.width - label_w - 1) // cell)
    cols = list(range(min(n_cols, fit)))
    rows = list(range(min(n_rows, MAX_ROWS)))
    top = float(weights.max()) or 1.0
    lines = [Text(_label(amap.title, console.width), style="bold")]
    height = min(LABEL_HEIGHT, max(len(amap.columns[c]) for c in cols))
    for level in range(height):  # column labels, vertical, one character a line
        line = Text(" " * (label_w + 1))
        for c in cols:
            name = _label(amap.columns[c], height)
            line.append((name[level] if level < len(name) else " ").ljust(cell))
        lines.append(line)
    for r in rows:
        line = Text(_label(amap.rows[r], label_w).rjust(label_w) + " ")
        strongest = int(weights[r].argmax())
        for c in cols:
            w = float(weights[r, c])
            mark = c == strongest
            if values:
                body = f"{w:.2f}"
                body = "1.0" if body.startswith("1") else body[1:]  # ".42", and "1.0" for weights that round to 1
                text = (body + ("*" if mark else " ")) if plain else (body + ("◆" if mark else " "))
            else:
                shade = SHADES[min(len(SHADES) - 1, round(w / top * (len(SHADES) - 1)))]
                text = ("◆ " if mark else " ".ljust(cell)) if not plain else (("*" if mark else shade) + shade)
            if plain:
                line.append(text[:cell].ljust(cell))
            else:
                level = w / top
                line.append(text[:cell].ljust(cell), style=f"{'black' if level > 0.6 else 'white'} on {_colour(level)}")
        lines.append(line)
    lines.append(_legend(top, plain, console.width))
    hidden = [f"keys {len(cols) + 1}–{n_cols} of {n_cols} not shown" if len(cols) < n_cols else "",
              f"queries {len(rows) + 1}–{n_rows} of {n_rows} not shown" if len(rows) < n_rows else ""]
    note = "; ".join(h for h in hidden if h)
    if note:
        lines.append(Text(_label(f"({note}: widen the terminal or use --save)", console.width), style="dim"))
    return Group(*lines)


def _legend(top: float, plain: bool, width: int) -> Text:
    legend = Text("0 ")
    if plain:
        legend.append(SHADES.replace(" ", "·"))
    else:
        for i in range(10):
            legend.append(" ", style=f"on {_colour(i / 9)}")
    legend.append(f" {top:.2f} (max) · ◆/* strongest key" if width >= 40 else f" {top:.2f}")
    legend.truncate(width)
    return legend


def print_maps(maps: list[AttentionMap], console: Console, values: bool = False) -> None:
    """Maps of one layer side by side as small multiples where the width allows, one layer after another."""
    from rich.columns import Columns

    for layer in sorted({m.layer for m in maps}):
        panels = [heatmap(m, console, values) for m in maps if m.layer == layer]
        console.print(Columns(panels, padding=(1, 3)) if len(panels) > 1 else panels[0], soft_wrap=False,
                      overflow="crop", no_wrap=True)
        console.print()


def save_image(maps: list[AttentionMap], path: Path) -> float:
    """A grid of maps (layers down, heads across) with token labels; format from the extension.
    Maps of one sentence share their tokens, which label the grid's edges only, as small multiples do:
    keys under the bottom row, queries left of the first column (drawn 2.2x as fast for base's 48 maps
    as with each map labelled: benchmarks/README.md). Returns the dots an inch it was drawn at
    (``image_dpi``): below READABLE_DPI the labels are left out, which would take most of the drawing's
    time and could not be read."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    layers = sorted({m.layer for m in maps})
    heads = sorted({m.head for m in maps}, key=str)
    n_rows, n_cols = len(layers), len(heads)
    first = maps[0]
    shared = all(m.rows == first.rows and m.columns == first.columns for m in maps)
    cell = 0.28  # inches a token
    # inches around each map (its title and colour bar, and its labels unless shared), and for the labels
    # on the grid's edges
    margin, edges = (0.8, 0.7) if shared else (1.5, 0.0)
    fig_w = max(4.0, n_cols * (len(first.columns) * cell + margin) + edges)
    fig_h = max(3.0, n_rows * (len(first.rows) * cell + margin) + edges)
    dpi = image_dpi(fig_w, fig_h, path)
    fig, axes = plt.subplots(n_rows, n_cols, figsize=(fig_w, fig_h), squeeze=False)
    placed = {(layers.index(m.layer), heads.index(m.head)): m for m in maps}
    for (row, col), amap in placed.items():
        ax = axes[row][col]
        # interpolation none: a cell is a flat square, and .svg/.pdf hold the weights, not a resampled picture
        image = ax.imshow(amap.weights.numpy(), cmap="viridis", vmin=0.0, aspect="auto", interpolation="none")
        # the edge's labels: keys under the lowest map of a column, queries left of the first map of a row
        bottom = not shared or row == max(r for r, c in placed if c == col)
        left = not shared or col == min(c for r, c in placed if r == row)
        keys = amap.columns if labelled(dpi) and bottom else []
        queries = amap.rows if labelled(dpi) and left else []
        # tokens are text: parse_math off, or a $ pair would be typeset as mathematics
        ax.set_xticks(range(len(keys)), keys, rotation=90, fontsize=8, parse_math=False)
        ax.set_yticks(range(len(queries)), queries, fontsize=8, parse_math=False)
        ax.set_title(amap.title, fontsize=9, parse_math=False)
        colorbar = fig.colorbar(image, ax=ax, fraction=0.046, pad=0.04)
        # drawn as vectors: a rasterized bar makes .svg and .pdf render the whole figure as pixels once per
        # bar (66 s instead of 11 s for base's 48 maps of a 30-token sentence)
        colorbar.solids.set_rasterized(False)
    write_figure(fig, path, dpi=dpi)  # laid out there
    plt.close(fig)
    return dpi


def labelled(dpi: float) -> bool:
    """Whether maps drawn at ``dpi`` get their token labels (READABLE_DPI)."""
    return dpi >= READABLE_DPI


def unlabelled_warning(maps: list[AttentionMap], path: Path, dpi: float) -> str | None:
    """What to tell of an image ``save_image`` drew at ``dpi`` without its labels, or None."""
    if labelled(dpi):
        return None
    return (f"--save {path}: {len(maps)} maps of {len(maps[0].columns)} tokens are drawn small, to keep the image "
            f"within {IMAGE_PIXELS // 1_000_000} M pixels, too small for their token labels, which are left out; a "
            ".svg or .pdf keeps them (or draw fewer maps: --layer N, --head N)")


def image_dpi(width: float, height: float, path: Path) -> float:
    """The dots an inch to draw a ``width`` x ``height``-inch figure at: IMAGE_DPI, or for a .png as many
    as keep it within IMAGE_PIXELS (a .svg or .pdf holds the labels as text, and each map's weights as
    they are, at any size)."""
    if path.suffix.lower() != ".png":
        return IMAGE_DPI
    return min(IMAGE_DPI, math.sqrt(IMAGE_PIXELS / (width * height)))
