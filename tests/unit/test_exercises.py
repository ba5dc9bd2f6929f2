"""The graders' logic without ranks: the registry, ``check``'s answers for a blank, a hang and
a crash, ``LABKIT_SOLUTIONS``, each grader's reading of made-up runs, and the pictures. (The
graders on real ranks: tests/ranks/test_exercises.py.)"""

from __future__ import annotations

import pytest
from torch.utils.data import DistributedSampler

from labkit import exercises
from labkit.exercises import _core, data_parallel, load_balancing, pipeline
from labkit.launch import LaunchTimeout, RankError
from labkit.pipeline_schedules import stage_actions
from labkit.plots import exercises as pictures

FINAL_LESSONS = {f"{i:02d}" for i in range(17)}  # 00 .. 16, the course's final numbering


def test_every_exercise_names_its_lesson_and_a_solution_that_exists():
    assert {
        "average_gradients",
        "ddp_by_hand",
        "bucketed_ddp",
        "one_f_one_b",
        "ring_all_reduce",
        "join_shadow",
        "zero1_step",
        "local_sgd_average",
        "megatron_mlp",
        "column_parallel_linear",
        "row_parallel_linear",
    } <= set(exercises.EXERCISES)
    for name, ex in exercises.EXERCISES.items():
        assert ex.lesson in FINAL_LESSONS, name
        assert callable(exercises.solution(name)), name
        assert ex.grade.__doc__, name  # what the learner writes and what it is held against


def test_check_refuses_an_unknown_name_and_a_non_function_before_anything_runs():
    with pytest.raises(ValueError, match="ring_all_reduce"):
        exercises.check("ring", lambda x: x)
    with pytest.raises(TypeError, match="needs your function"):
        exercises.check("ring_all_reduce", None)
    with pytest.raises(ValueError, match="registered twice"):
        _core.exercise("ring_all_reduce", lesson="06", what="", solution="")(lambda fn, t: None)


@pytest.fixture
def fake(monkeypatch, tmp_path):
    """An exercise whose grader runs the function here, raising what a launch would raise."""

    def grade(fn, timeout_s):
        try:
            ok = fn()
        except NotImplementedError:  # as a launch raises it: from a rank
            raise RankError(0, 2, "Traceback ...\nNotImplementedError: your answer") from None
        return _core.Verdict("fake", ok, "graded")

    (tmp_path / "fake.py").write_text("def my_fake():\n    return True\n")
    monkeypatch.setattr(_core, "SOLUTIONS", tmp_path)
    monkeypatch.setitem(_core.EXERCISES, "fake", _core.Exercise("fake", grade, "00", "", "my_fake",
                                                                 "advice"))  # fmt: skip
    return grade


def blank():
    raise NotImplementedError("your answer")


def test_a_blank_is_not_written_yet_unless_labkit_solutions_grades_the_solution(fake, monkeypatch):
    verdict = exercises.check("fake", blank)
    assert verdict.passed is None and "NotImplementedError" in verdict.message
    monkeypatch.setenv("LABKIT_SOLUTIONS", "1")
    verdict = exercises.check("fake", blank)
    assert verdict.passed is True and verdict.graded == "solution"
    assert "LABKIT_SOLUTIONS=1" in verdict.message
    mine = exercises.check("fake", lambda: False)  # a written answer is graded as it is
    assert mine.passed is False and mine.graded == "yours"


def test_a_blank_tried_in_this_process_is_not_written_yet_either(fake, monkeypatch):
    def here(fn, timeout_s):  # a grader that calls the function in the caller first
        return _core.Verdict("fake", fn(), "graded")

    monkeypatch.setitem(_core.EXERCISES, "fake", _core.Exercise("fake", here, "00", "", "my_fake",
                                                                 "advice"))  # fmt: skip
    assert exercises.check("fake", blank).passed is None


def test_a_hang_names_each_rank_and_the_call_it_waits_in(fake, monkeypatch):
    stacks = {
        0: '  File "torch/distributed/distributed_c10d.py", line 3387 in recv\n'
        '  File "<dynamic-code>", line 8 in step\n',
        1: '  File "torch/distributed/distributed_c10d.py", line 2901 in all_reduce\n',
    }

    def hangs(fn, timeout_s):
        raise LaunchTimeout(4, stacks)

    monkeypatch.setitem(_core.EXERCISES, "fake", _core.Exercise("fake", hangs, "00", "", "my_fake",
                                                                 "Follow the order."))  # fmt: skip
    verdict = exercises.check("fake", blank)
    assert verdict.passed is False
    assert "after 4 s rank 0 in recv, rank 1 in all_reduce was still waiting" in verdict.message
    assert verdict.message.endswith("Follow the order.")


def test_a_crash_is_quoted_and_a_graders_feedback_is_the_answer():
    plain = RankError(1, 2, "Traceback ...\nValueError: bad shape")
    assert _core.raised(plain).startswith("Rank 1 raised an error: ValueError: bad shape")
    said = RankError(1, 2, "Traceback ...\nlabkit.exercises._core.Feedback: stage 1 started ...")
    assert _core.feedback(said) == "Stage 1 started ..." and _core.feedback(plain) is None
    gloo = RankError(
        0,
        2,
        "process exited with code -6",
        stderr_tail="Received data size "
        "doesn't match expected size. Is there a distributed collective mismatch",
    )
    assert "collectives that do not match" in _core.raised(gloo)  # fmt: skip


def test_a_verdict_reads_as_a_sentence_and_as_markdown():
    v = _core.Verdict("ring_all_reduce", False, "The sums are right, but ...")
    assert str(v) == "ring_all_reduce: NOT YET. The sums are right, but ..."
    assert v._repr_markdown_().startswith("**ring_all_reduce: ❌ not yet.**")


# ---- each grader's reading of a run, on made-up runs -------------------------------------------


def test_ddp_by_hand_deals_what_torchs_sampler_deals_and_names_each_data_mistake():
    share = data_parallel.SAMPLES // 2
    for r in range(2):
        for epoch in range(data_parallel.EPOCHS):
            s = DistributedSampler(range(data_parallel.SAMPLES), num_replicas=2, rank=r, seed=0)
            s.set_epoch(epoch)
            assert data_parallel.dealt(2)[epoch][r] == list(s)
    dealt = data_parallel.dealt(2)
    right = dealt[0][1] + dealt[1][1]
    assert data_parallel._data_wrong(right, 1, 2) is None
    assert dealt[0][1] != dealt[1][1]  # so the same order twice is a missing set_epoch
    assert "set_epoch" in data_parallel._data_wrong(dealt[0][1] * 2, 1, 2)
    assert "whole dataset" in data_parallel._data_wrong(list(range(24)) * 2, 1, 2)
    assert "unshuffled" in data_parallel._data_wrong(list(range(1, 24, 2)) * 2, 1, 2)
    assert f"its share is {share}" in data_parallel._data_wrong(right[:-1], 1, 2)


def pipe_run(orders: list, sends: int, peak: list) -> list[dict]:
    return [{"order": o, "wrong_inputs": [], "grad_diff": 0.0, "sends": sends / len(orders),
             "bytes": sends / len(orders) * 96, "message_bytes": 96, "peak": p}
            for o, p in zip(orders, peak)]  # fmt: skip


def test_the_pipeline_grader_knows_1f1b_from_gpipe_and_counts_the_messages():
    M, P = pipeline.MICROBATCHES, 2
    ones = [stage_actions("1f1b", P, M, s) for s in range(P)]
    assert pipeline._pipe_wrong(pipe_run(ones, 2 * M, [2, 1]), P) is None
    gpipe = [stage_actions("gpipe", P, M, s) for s in range(P)]
    said = pipeline._pipe_wrong(pipe_run(gpipe, 2 * M, [M, 1]), P)
    assert "that is GPipe" in said and f"held {M} micro-batches" in said
    assert "you sent 4 messages per micro-batch" in pipeline._pipe_wrong(
        pipe_run(ones, 4 * M, [2, 1]), P
    )
    wrong_input = pipe_run(ones, 2 * M, [2, 1])
    wrong_input[1]["wrong_inputs"] = [("F", 2)]
    wrong_input[0]["wrong_inputs"] = [("B", 2)]  # a consequence: the forward is named
    assert "stage 1's forward of micro-batch 2 got an input" in pipeline._pipe_wrong(wrong_input, P)


def test_the_join_grader_names_the_first_collective_the_ranks_disagree_on():
    join = {"op": "allreduce", "numel": 1, "dtype": "float32", "phase": "join"}
    grads = {"op": "allreduce", "numel": 35, "dtype": "float64", "phase": "gradients"}
    assert load_balancing._mismatch([[join, grads], [join, grads]]) is None
    said = load_balancing._mismatch([[join, join], [join, grads]])
    assert said == (
        "rank 0 all-reduced 1 float32 element (Join's count of the ranks still training), "
        "while rank 1 all-reduced 35 float64 elements (its gradients and sample count)"
    )


# ---- the pictures, on made-up runs ---------------------------------------------------------------


def test_the_pictures_draw_what_the_grader_recorded():
    calls = [{"op": "allreduce", "numel": k, "issued": t, "done": t + 1e-3, "phase": "backward"}
             for k, t in ((19, 1e-3), (72, 2e-3), (42, 5e-3))]  # fmt: skip
    step = {"backward": 4e-3, "finish": 6e-3, "calls": calls}
    fig = pictures.bucket_timeline([step, step], step=3)
    names = [t.name for t in fig.data]
    assert names.count("all-reduce started in backward") == 4  # two ranks, two each
    assert names.count("all-reduce started after") == 2  # the third started at 5 ms, after
    events = [{"kind": k, "microbatch": 0, "stage": s, "start": 0.0, "end": 1.0}
              for s in range(2) for k in "FB"]  # fmt: skip
    messages = [{"kind": "send", "peer": 1, "stage": 0, "start": 1.0, "end": 1.0},
                {"kind": "recv", "peer": 0, "stage": 1, "start": 0.0, "end": 1.0}]  # fmt: skip
    fig = pictures.pipeline_timeline(events, messages, "t")
    assert {t.name for t in fig.data} == {"forward", "backward", "waiting in recv", "send"}
    ranks = [{"state_bytes": 100, "sent_per_step": 50}, {"state_bytes": 120, "sent_per_step": 70}]
    fig = pictures.zero1_bytes(ranks, param_bytes=220)
    assert list(fig.data[3].y) == [110.0, 110.0]  # (n-1)/n of the parameters, per rank
