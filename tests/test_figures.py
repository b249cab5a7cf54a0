"""Figures are reproducible: the same figure saved twice gives byte-identical PNG and SVG (issue 15)."""

import matplotlib.pyplot as plt
import pandas as pd
import seaborn as sns

from nopelens.analyses.figures import save_figure


def figure(shift=0.0):
    data = pd.DataFrame(
        {"layer": [0, 1, 2] * 2, "value": [0.1, 0.5 + shift, 0.9, 0.2, 0.3, 0.4], "model": ["a"] * 3 + ["b"] * 3}
    )
    fig, ax = plt.subplots(figsize=(3, 2))
    sns.lineplot(data=data, x="layer", y="value", hue="model", marker="o", ax=ax)  # clip paths, legend, text
    ax.fill_between([0, 1, 2], [0, 0.1, 0.2], [0.3, 0.4, 0.5], alpha=0.2)
    ax.set_title("R² per layer")
    return fig


def test_saving_the_same_figure_twice_gives_identical_files(tmp_path):
    first = save_figure(figure(), tmp_path / "one")
    second = save_figure(figure(), tmp_path / "two")
    other = save_figure(figure(shift=0.2), tmp_path / "three")
    for a, b, c in zip(first, second, other):
        assert a.read_bytes() == b.read_bytes(), a.name
        assert a.read_bytes() != c.read_bytes(), a.name  # the comparison can fail
    svg = first[1].read_text()
    assert "<dc:date>" not in svg and "clip-path" in svg


# ----------------------------------------------------------------------------- one palette (issue 49)
import matplotlib.colors  # noqa: E402

from nopelens.analyses import figures, layers, lengthgen_figures, palette, report  # noqa: E402
from nopelens.models.methods import METHODS  # noqa: E402

SUBJECTS = {  # as a run's done.json records them (SweepResult.subjects), keyed by run label
    "text-nope-4l": {"name": "text-nope-4l", "position": "nope", "kind": "trained"},
    "text-rope-4l": {"name": "text-rope-4l", "position": "rope", "kind": "trained"},
    "text-hybrid-4l (seed 1)": {"name": "text-hybrid-4l", "position": "rope+nope", "kind": "trained"},
    "hf:smol": {"name": "hf:smol", "position": "rope,rope,rope,nope", "kind": "external"},
    "circuit": {"name": "circuit", "position": "nope", "kind": "circuit"},
    "untrained-nope": {"name": "untrained-nope", "position": "nope", "kind": "untrained"},
    "constant-alibi": {"name": "constant-alibi", "position": "alibi", "kind": "constant"},
}


def curves(models):
    rows = [
        dict(
            model=model,
            train_seed=0,
            layer=layer,
            curve=curve.key,
            metric="r2",
            value=0.1 * layer,
            ci_low=0.0,
            ci_high=0.3,
            threshold=0.9,
            clears=False,
            n_heads=None,
        )
        for model in models
        for curve in layers.curves_of()
        for layer in range(3)
    ]
    return pd.DataFrame(rows)


def drawn_styles(fig):
    """Model -> (colour, line style) of the lines a figure was drawn with (axes lines labelled by
    model, and the legend's handles), checked to agree."""
    seen = {}
    for ax in fig.axes:
        for line in ax.lines:
            if line.get_label() in {record["name"] for record in SUBJECTS.values()}:
                style = (matplotlib.colors.to_hex(line.get_color()), line.get_linestyle())
                assert seen.setdefault(line.get_label(), style) == style, line.get_label()
    for handle in fig.legends[0].legend_handles:
        model = handle.get_label().split(" (")[0]
        assert seen[model] == (matplotlib.colors.to_hex(handle.get_color()), handle.get_linestyle()), model
    plt.close(fig)
    return seen


def test_every_registered_method_has_a_colour_of_its_own():
    assert set(palette.METHOD_COLORS) == set(METHODS)
    colours = [*palette.METHOD_COLORS.values(), *palette.HYBRID_COLORS, palette.UNKNOWN_COLOR]
    assert len(set(colours)) == len(colours)


def test_a_method_keeps_its_colour_whatever_the_models_and_their_order():
    first = drawn_styles(figures.probe_figure(curves(["text-rope-4l", "circuit", "text-nope-4l"]), subjects=SUBJECTS))
    second = drawn_styles(
        figures.probe_figure(
            curves(["constant-alibi", "text-nope-4l", "untrained-nope", "text-hybrid-4l", "hf:smol", "text-rope-4l"]),
            subjects=SUBJECTS,
        )
    )
    for model in set(first) & set(second):
        assert first[model] == second[model], model
    nope, rope = palette.METHOD_COLORS["nope"], palette.METHOD_COLORS["rope"]
    assert first["text-nope-4l"] == (nope.lower(), "-") and first["text-rope-4l"] == (rope.lower(), "-")
    assert first["circuit"] == (nope.lower(), "--"), "the positive control: NoPE's colour, dashed"
    assert second["untrained-nope"] == (nope.lower(), ":") and second["constant-alibi"][1] == "-.", "negative controls"
    assert second["text-hybrid-4l"] == second["hf:smol"], "a hybrid's colour is fixed by its methods, not its spelling"
    assert second["text-hybrid-4l"][0] not in {c.lower() for c in palette.METHOD_COLORS.values()}


def test_every_figure_of_a_run_counts_layers_the_same_way():
    """sites.png counted blocks where probes.png counted layers (block + 1): one x for one point."""
    base = dict(
        probe="linear",
        split="grouped",
        target="absolute_index",
        task="regression",
        metric="r2",
        model="circuit",
        ci_low=0.0,
        ci_high=1.0,
    )
    probes = pd.DataFrame(
        [
            *[
                dict(base, layer=layer, block=None, site=f"blocks.{layer}.hook_resid_pre", value=v)
                for layer, v in ((0, 0.1), (1, 0.9), (2, 1.0))
            ],
            dict(base, layer=None, block=0, site="blocks.0.hook_attn_out", value=0.5),
        ]
    ).astype({"layer": "Int64", "block": "Int64"})
    sites = figures.site_figure(probes, SUBJECTS)
    residual = next(line for ax in sites.axes for line in ax.lines if line.get_label().startswith("residual"))
    assert list(residual.get_xdata()) == [0, 1, 2] and list(residual.get_ydata()) == [0.1, 0.9, 1.0]
    panel = sites.axes[0]
    assert panel.get_xlabel() == figures.LAYER_AXIS and panel.title.get_color() == palette.METHOD_COLORS["nope"]
    attn = next(line for line in panel.lines if line.get_marker() == "o" and line.get_linestyle() == "None")
    assert list(attn.get_xdata()) == [0.25], "block 0's attention output sits between layer 0 and layer 1"
    plt.close(sites)
    probe = figures.probe_figure(curves(["circuit"]), subjects=SUBJECTS)
    assert {ax.get_xlabel() for ax in probe.axes if ax.get_visible()} == {figures.LAYER_AXIS}
    plt.close(probe)


def test_summary_captions_say_what_a_point_is():
    for stem in report.SWEEP_FIGURES:
        assert report.FIGURE_CAPTIONS[stem].startswith(("A point is", "A cell is", "A pair of bars is")), stem


def test_lengthgen_draws_each_method_in_its_colour():
    rows = [
        dict(task="copy", method=method, seed=0, length=n, exact_match=1.0 / n, in_distribution=n <= 2, train_max_len=2)
        for method in ("rope", "nope", "alibi")
        for n in (1, 2, 3)
    ]
    fig = lengthgen_figures.lengthgen_figure(pd.DataFrame(rows))
    drawn = {
        line.get_label(): matplotlib.colors.to_hex(line.get_color())
        for line in fig.axes[0].lines
        if line.get_label() in METHODS
    }
    assert drawn == {m: palette.METHOD_COLORS[m].lower() for m in ("rope", "nope", "alibi")}
    plt.close(fig)


def test_panel_titles_of_the_default_sweeps_sink_figure_do_not_overlap():
    """The bottom row's two negative controls had titles too long for their panels."""
    import numpy as np

    models = {
        "text-nope-4l": ("nope", "trained", 4),
        "text-hybrid-4l": ("rope+nope", "trained", 4),
        "circuit": ("nope", "circuit", 1),
        "untrained-nope": ("nope", "untrained", 4),
        "constant-nope": ("nope", "constant", 4),
    }
    rows = [
        dict(model=model, condition="with_bos", block=block, head=head, sink_score=0.5)
        for model, (_, _, heads) in models.items()
        for block in range(2)
        for head in range(heads)
    ]
    subjects = {model: {"position": position, "kind": kind} for model, (position, kind, _) in models.items()}
    fig = figures.sink_figure(pd.DataFrame(rows), subjects=subjects)
    renderer = fig.canvas.get_renderer()
    boxes = [ax.title.get_window_extent(renderer) for ax in fig.axes if ax.get_title()]
    assert len(boxes) == len(models)
    for i, a in enumerate(boxes):
        for b in boxes[i + 1 :]:
            assert not a.overlaps(b), (a, b)
    assert np.isfinite([box.width for box in boxes]).all()
    plt.close(fig)
