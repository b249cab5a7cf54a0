"""The sweep's ETA knows which tasks train and which only measure (issue 23)."""

import pytest

from nopelens.analyses.subjects import planned_work
from nopelens.analyses.sweep.eta import MEASURE_PRIOR, TRAIN_PRIOR, SweepETA, TaskWork
from nopelens.models import zoo

TRAIN = TaskWork(1000, 1000 * 16 * 65 * 0.85e6, 5 * (80 * 64 + 5120))  # text-nope-4l, not cached yet
READ = TaskWork(0, 0.0, 5 * (80 * 64 + 5120))  # a cached model or a control


def sweep_of_one_training_and_five_reads(jobs=1):
    return SweepETA({"train": TRAIN, **{f"read{i}": READ for i in range(5)}}, jobs=jobs)


def test_before_any_task_finishes_training_counts_far_more_than_measuring():
    eta = sweep_of_one_training_and_five_reads()
    assert eta.cost("train") > 3 * eta.cost("read0")
    assert eta.remaining() == pytest.approx(TRAIN.train_work * TRAIN_PRIOR + 6 * READ.measure_work * MEASURE_PRIOR)
    assert eta.describe().endswith("1 to train, 5 to measure")


def test_after_the_training_task_the_rest_is_estimated_from_measuring_time_not_from_its_total():
    """tqdm would extrapolate the first task's 300 s to the five left (25 min); they take 20 s each."""
    eta = sweep_of_one_training_and_five_reads()
    eta.finished("train", train_seconds=280.0, measure_seconds=20.0)
    assert eta.remaining() == pytest.approx(5 * 20.0)
    assert eta.remaining(since_last=30.0) == pytest.approx(70.0), "time spent on the running task counts"
    assert eta.describe() == "about 2 min left: 0 to train, 5 to measure"
    eta.finished("read0", train_seconds=1.0, measure_seconds=9.0)  # loading counts as measuring
    assert eta.rate("measure") == pytest.approx(30.0 / (2 * READ.measure_work))
    for key in ("read1", "read2", "read3", "read4"):
        eta.finished(key, 0.0, 15.0)
    assert eta.remaining() == 0 and eta.describe() == "done"


def test_workers_share_what_is_left():
    one, two = sweep_of_one_training_and_five_reads(1), sweep_of_one_training_and_five_reads(2)
    assert two.remaining() == pytest.approx(one.remaining() / 2)


def test_planned_work_knows_what_will_train(tmp_path, monkeypatch):
    monkeypatch.setenv("NOPELENS_CACHE", str(tmp_path))  # an empty cache: a shipped model only loads
    assert zoo.is_shipped("text-nope-4l") and not planned_work("text-nope-4l", 80, 64).trains
    monkeypatch.setattr(zoo, "is_shipped", lambda *args: False)  # nor shipped: it trains
    fresh = planned_work("text-nope-4l", 80, 64)
    recipe = zoo.recipe("text-nope-4l")
    assert fresh.trains and fresh.train_steps == recipe.steps
    assert fresh.train_work == pytest.approx(recipe.steps * 16 * 65 * (4 * 12 * 128**2 + 2 * 258 * 128))
    assert planned_work("text-nope-4l", 80, 64, quick_steps=30).train_steps == 30
    for control in ("circuit", "untrained-nope", "constant-nope"):
        assert not planned_work(control, 80, 64).trains, control
    assert planned_work("circuit", 80, 64).measure_work < fresh.measure_work, "two blocks, not four"


def test_a_model_whose_size_is_not_read_ahead_gets_no_time(tmp_path):
    """An HF directory or a checkpoint may be 3 B parameters: the zoo's priors say nothing about it."""
    hf, checkpoint = planned_work("hf:/some/dir", 80, 64), planned_work(str(tmp_path), 80, 64)
    assert not hf.estimated and not checkpoint.estimated
    assert planned_work("circuit", 80, 64).estimated and planned_work("untrained-nope", 80, 64).estimated
    alone = SweepETA({"hf": hf})
    assert alone.describe() == "time left not estimated: 0 to train, 1 to measure"
    mixed = SweepETA({"hf": hf, "read": READ})
    assert mixed.remaining() == pytest.approx(READ.measure_work * MEASURE_PRIOR)
    assert mixed.describe().startswith("about ") and "(1 not estimated): 0 to train, 2 to measure" in mixed.describe()
    mixed.finished("hf", train_seconds=5.0, measure_seconds=3000.0)
    assert mixed.rate("measure") == MEASURE_PRIOR, "its time says nothing about the rate of the zoo's models"


def test_the_probes_plan_reads_in_lines_of_at_most_100_columns():
    """``nopelens probe``'s plan (every part of the work at once) is a headline and one wrapped item per
    part, none wider than 100 columns, with the numbers and phrases a reader looks for unbroken."""
    from nopelens.analyses.sweep.plan import PLAN_WIDTH, Plan

    note = (
        "3 min of forward passes and 17 min of fits (a batch's first block timed here, the fits' factorizations "
        "and products counted and timed here at d = 1024)"
    )
    plan = Plan(
        forward_passes=123,
        tokens=456_789,
        statistics_bytes=3 * 2**30,
        keep_bytes=2**29,
        eta_seconds=1234.0,
        eta_note=note,
        ablation_passes=40,
        ablated_blocks=4,
        batch_size=8,
        shortfall="too large",
        groups=3,
        held_bytes=2**30,
        stripped_passes=10,
        second_passes=20,
        ablation_second_passes=5,
    )
    text = plan.describe("hf:/models/SmolLM3-3B")
    lines = text.splitlines()
    assert PLAN_WIDTH == 100 and len(lines) >= 8 and max(map(len, lines)) <= PLAN_WIDTH, text
    assert lines[0].startswith("nopelens: plan for hf:/models/SmolLM3-3B: 123 forward passes over 456,789 tokens")
    assert all(line.startswith(("  - ", "    ")) for line in lines[1:]), text
    for phrase in (
        "3 groups whose statistics fit the memory",
        "40 of them for the sink ablation of 4 blocks",
        "statistics 3,072.0 MiB in all",
        "ETA about 21 min",
        "WILL NOT FIT (the error line says why)",
    ):
        assert phrase in text, phrase
    short = Plan(1, 64, 2**20, 0, None, "not estimated").describe("m")
    assert "in batches of at most 32 sequences" in short and "WILL NOT FIT" not in short
    assert "no second pass" in short and max(map(len, short.splitlines())) <= PLAN_WIDTH


def test_the_opening_eta_is_measured_on_this_machine(monkeypatch):
    """Issue 49: before any task finishes, the priors are scaled by the machine's speed measured when
    the sweep starts (a busy machine three times slower: an ETA three times longer); an observed rate
    replaces them."""
    from nopelens.analyses.sweep import eta as eta_module

    assert eta_module.speed_probe(repeats=2) > 0
    monkeypatch.setattr(eta_module, "speed_probe", lambda: 3 * eta_module.SPEED_PROBE_SECONDS)
    slow = SweepETA({"read0": READ, "read1": READ}, speed=eta_module.speed_factor())
    assert slow.remaining() == pytest.approx(3 * 2 * READ.measure_work * MEASURE_PRIOR)
    slow.finished("read0", 0.0, 12.0)
    assert slow.remaining() == pytest.approx(12.0)
